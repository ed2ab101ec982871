"""Activation logical specs: every activation constraint a side's train step applies.

Parameters carry their logical names as metadata; activations do not: a
constraint's names are resolved to mesh axes while tracing and only the
physical spec reaches the program. Two names the rules map to the same mesh
axis are then the same program here and a resharding under other rules. So
the names are read where flax resolves them: the train step is traced
(`jax.make_jaxpr`: nothing compiled, nothing run) under a one-device mesh
whose axes are the rules' logical names themselves, with the rules mapping
each name to the axis of that name. Every sharding constraint in the traced
program then spells the logical names it was given, whichever API the model
called (`nn.with_logical_constraint`, or a helper around
`jax.lax.with_sharding_constraint`).

One row per constraint, in program order (forward, rematerialised forward,
backward): the innermost model method that applied it (from the trace's
source information), the control flow around it (`jit/scan/remat2`), shape,
dtype, logical names and, given a mesh, the physical spec the real rules
give. A name the rules do not know resolves to no axis, as in a real run.
"""
from __future__ import annotations

import contextlib
import difflib
import os
from typing import Any, Mapping

import flax
import flax.linen as nn
import jax
import jax.extend as jex
import numpy as np
import optax

from parity.core import specs
from parity.core.specs import format_names
from parity.core import compat

Row = dict[str, Any]

# Frames in these packages are not the model's own code.
_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (jax, flax, optax, np)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _site(source_info) -> str:
  """The innermost model method in the traceback (`Attention.__call__`)."""
  traceback = source_info.traceback
  frames = [] if traceback is None else traceback.frames
  own = [f for f in frames if not f.file_name.startswith(_LIBRARY_DIRS)]
  methods = [f.function_name for f in own if '.' in f.function_name and '<' not in f.function_name]
  if methods:
    return methods[0]
  return own[0].function_name if own else '?'


def _constraints(jaxpr, context: tuple[str, ...], out: list[tuple]) -> None:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'sharding_constraint':
      (operand,) = eqn.invars
      spec = tuple(eqn.params['sharding'].spec)
      out.append((_site(eqn.source_info), '/'.join(context), operand.aval, spec))
    for sub in jex.core.jaxprs_in_params(eqn.params):
      _constraints(sub, context + (eqn.primitive.name,), out)


def _names(entry: Any) -> Any:
  if entry is None:
    return None
  if isinstance(entry, tuple):
    return list(entry) if len(entry) != 1 else entry[0]
  return entry


def rows(
    side: Any, state: Any, batch: Any, dropout_base: Any,
    rules: specs.Rules = specs.DEFAULT_RULES, mesh_sizes: Mapping[str, int] | None = None,
) -> list[Row]:
  """The activation constraints of `side`'s train step (a side off any mesh).

  `state`, `batch` and `dropout_base` may be abstract (ShapeDtypeStructs).
  """
  names = sorted({name for name, _ in rules})
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch, dropout_base))
  step = side.train_step_function()
  if len(names) > NAMED_AXES_AT_ONCE:
    # One mesh axis per name cannot hold a production model's rules (an array has at most
    # 64 axes): a first trace finds the names the step asks for, the mesh takes only those.
    names = sorted(set(_asked(step, abstract, names)) & set(names))
    if len(names) > NAMED_AXES_AT_ONCE:
      raise ValueError(f'activation constraints name {len(names)} logical axes in one train step;'
                       f' at most {NAMED_AXES_AT_ONCE} can be read at once')
  devices = np.array(jax.devices()[:1]).reshape((1,) * len(names))  # traced, never run
  mesh = jax.sharding.Mesh(devices, tuple(names))
  with compat.use_mesh(mesh), nn.logical_axis_rules([(n, n) for n in names]), \
      compat.logical_constraint_names() as asked:
    jaxpr = jax.make_jaxpr(step)(*abstract)
  unknown = sorted(set(asked) - {name for name, _ in rules})
  if unknown:
    # flax would leave them unsharded on both sides: equal, and never compared.
    raise ValueError(
        f'activation constraints name logical axes the rules do not know: {unknown};'
        f' rules know {sorted({name for name, _ in rules})}. Add them to the rules (Pair(rules=...)) to compare them'
    )
  found: list[tuple] = []
  _constraints(jaxpr.jaxpr, (), found)
  out = []
  for index, (site, context, aval, spec) in enumerate(found):
    logical = [_names(e) for e in spec] + [None] * (len(aval.shape) - len(spec))
    out.append({
        'index': index,
        'site': site,
        'context': context,
        'shape': [int(d) for d in aval.shape],
        'dtype': np.dtype(aval.dtype).name,
        'logical': logical,
        'physical': (
            list(specs.physical_spec(tuple(logical), rules, mesh_sizes)) if mesh_sizes else None
        ),
    })
  return out


# The most logical names read in one trace (one mesh axis each; numpy arrays have at most 64 axes).
NAMED_AXES_AT_ONCE = 48


def _asked(step, abstract, names) -> list[str]:
  """The logical names the step's constraints ask for (a trace with every name unsharded)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('parity_names',))
  with compat.use_mesh(mesh), nn.logical_axis_rules([(n, None) for n in names]), \
      compat.logical_constraint_names() as asked:
    jax.make_jaxpr(step)(*abstract)
  return list(asked)


def unnamed(rows_: list[Row]) -> bool:
  """True when no constraint carries a logical name (the model resolved them itself, or none)."""
  return all(name is None for row in rows_ for name in row['logical'])


def physical_rows(side: Any, state: Any, batch: Any, dropout_base: Any) -> list[Row]:
  """The activation constraints of `side`'s train step as its own mesh and rules resolve them
  (a side placed on a mesh): the physical specs the program carries."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch, dropout_base))
  context = getattr(side, 'tracing_context', contextlib.nullcontext)  # the side's mesh and rules
  with context():
    jaxpr = jax.make_jaxpr(side.train_step_function())(*abstract)
  found: list[tuple] = []
  _constraints(jaxpr.jaxpr, (), found)
  return [{
      'index': index, 'site': site, 'context': context, 'shape': [int(d) for d in aval.shape],
      'dtype': np.dtype(aval.dtype).name, 'logical': [None] * len(aval.shape),
      'physical': [_names(e) for e in spec] + [None] * (len(aval.shape) - len(spec)),
  } for index, (site, context, aval, spec) in enumerate(found)]


def _key(row: Row, sites: bool) -> tuple:
  return (row['site'] if sites else None, row['context'], tuple(row['shape']), row['dtype'])


def drift(linen_rows: list[Row], nnx_rows: list[Row], sites: bool = True) -> list[str]:
  """Every constraint that differs between the sides, naming the site and both values.

  `sites=False`: the model methods that apply a constraint may have other
  names on each side (a user's port renames its classes); the constraints
  must still come in the same order, control flow, shape and dtype.
  """
  out = []
  # Aligned by what each constraint applies to (control flow, shape, dtype), not by
  # position: a constraint one side lacks is one line, not a shift of every later one.
  keys = [[_key(r, sites) for r in rows] for rows in (linen_rows, nnx_rows)]
  matcher = difflib.SequenceMatcher(None, *keys, autojunk=False)
  for op, i1, i2, j1, j2 in matcher.get_opcodes():
    pairs = list(zip(linen_rows[i1:i2], nnx_rows[j1:j2]))
    for a, b in pairs:
      where = f"#{a['index']} {a['site']} ({a['context']})"
      if _key(a, sites) != _key(b, sites):
        out.append(
            f"{where}: Linen {a['site']} {a['shape']} {a['dtype']} vs NNX #{b['index']} {b['site']}"
            f" ({b['context']}) {b['shape']} {b['dtype']}"
        )
      elif a['logical'] != b['logical']:
        out.append(f"{where}: logical Linen {format_names(a['logical'])} vs NNX #{b['index']}"
                   f" {format_names(b['logical'])}")
      elif a['physical'] != b['physical']:
        out.append(f"{where}: physical Linen {format_names(a['physical'])} vs NNX #{b['index']}"
                   f" {format_names(b['physical'])}")
    for extra, side in ((linen_rows[i1 + len(pairs):i2], 'Linen'), (nnx_rows[j1 + len(pairs):j2], 'NNX')):
      for row in extra:
        out.append(
            f"#{row['index']} {row['site']} ({row['context']}) {row['shape']} {row['dtype']}: only on"
            f" {side}, logical {format_names(row['logical'])}"
        )
  return out


def format_table(rows: list[Row]) -> str:
  """One line per constraint, in program order (the text golden's format)."""
  lines = []
  for r in rows:
    shape = '[' + ','.join(str(d) for d in r['shape']) + ']'
    physical = '' if r['physical'] is None else ' ' + format_names(r['physical'])
    lines.append(
        f"{r['index']:04d} {r['site']} {r['context']} {shape} {r['dtype']}"
        f" {format_names(r['logical'])}{physical}\n"
    )
  return ''.join(lines)
