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
backward): the module it is in, the innermost model method that applied it
(from the trace's source information), the control flow around it
(`jit/scan/remat2`), shape, dtype, logical names and, given a mesh, the
physical spec the real rules give. A name the rules do not know resolves to
no axis, as in a real run.

The module is read from jax's name stack, which the trace keeps per
operation, backward pass included: Linen pushes each module's name onto it;
an NNX side's module calls are named by their Linen paths for the trace
(parity/compare/scopes.py), and the row gives both, `module` (the NNX
attribute path) and `linen_module` (the pair's correspondences applied).
Inside a scanned body the path is the stack's (`layers/mlp`): one
constraint there is every layer's.
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

from flax import nnx

from parity.core import specs
from parity.core.specs import format_names
from parity.core import compat
from parity.compare import scopes

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


def _constraints(jaxpr, context: tuple[str, ...], out: list[tuple], scope: tuple[str, ...] = ()) -> None:
  for eqn in jaxpr.eqns:
    # A body's name stack continues the stack of the equation that holds it.
    here = scope + _scope_names(eqn.source_info.name_stack)
    if eqn.primitive.name == 'sharding_constraint':
      (operand,) = eqn.invars
      spec = tuple(eqn.params['sharding'].spec)
      out.append((_site(eqn.source_info), '/'.join(context), operand.aval, spec, _module_path(here)))
    for sub in jex.core.jaxprs_in_params(eqn.params):
      _constraints(sub, context + (eqn.primitive.name,), out, here)


# The named scope around the outermost module call of a traced step (`_named_modules`): module
# paths start after it, as parameter paths start below the model.
ROOT_MARK = 'parity-model'
# Scopes jax pushes itself, not a module's: remat names the forward pass it recomputes.
_JAX_SCOPES = frozenset({'rematted_computation'})
ROOT = '(model)'  # the outermost module's own path, printed


def _scope_names(name_stack) -> tuple[str, ...]:
  """The named scopes of an equation's name stack, transforms (`jvp`, `transpose`) left out."""
  # `Scope` and `Transform` items (jax._src.source_info_util, jax 0.10 to 0.12); a stack of
  # another form gives no scope, and so no module path.
  return tuple(item.name for item in getattr(name_stack, 'stack', ()) if type(item).__name__ == 'Scope')


def _module_path(names: tuple[str, ...]) -> str:
  """The module path that scope names read (`layers/mlp`; '' for the outermost module)."""
  # After the root's mark where there is one (an equation jax moves out of a scanned body
  # keeps the body's own names, which start at the stack); jax's own scopes left out; a
  # Linen method's scope (`embed.attend`) read as its module's.
  root = ''
  if ROOT_MARK in names:
    at = len(names) - 1 - names[::-1].index(ROOT_MARK)
    root = names[at - 1].partition('.')[0] if at else ''
    names = names[at + 1:]
  parts: list[str] = []
  for name in names:
    if name in _JAX_SCOPES or name == ROOT_MARK:
      continue
    module, dot, _ = name.partition('.')
    if dot:  # a method other than __call__: the module's own scope, or its name
      if (parts and parts[-1].rsplit('/', 1)[-1] == module) or (not parts and module == root):
        continue
      name = module
    parts.append(name)
  return '/'.join(parts)


def _nnx_model(side: Any) -> Any:
  """An NNX side's `(model, optimizer)` of abstract arrays (None: not an NNX side)."""
  graphdef, template = getattr(side, 'graphdef', None), getattr(side, 'template', None)
  if not isinstance(graphdef, nnx.GraphDef) or template is None:
    return None
  with compat.eager_sharding_off():
    return nnx.merge(graphdef, template)


@contextlib.contextmanager
def _named_modules(side: Any):
  """A context naming each module call of `side`'s step in jax's name stack; yields Linen path -> side's."""
  # The outermost call marked (`ROOT_MARK`); traced anew, not taken from jit's cache, which
  # keeps a trace without the names.
  sample = _nnx_model(side)
  depth = [0]

  def mark(call):
    def marked(*args, **kwargs):
      if depth[0]:
        return call(*args, **kwargs)
      depth[0] += 1
      try:
        with jax.named_scope(ROOT_MARK):
          return call(*args, **kwargs)
      finally:
        depth[0] -= 1
    return marked

  if sample is None:  # Linen names its modules itself; the mark goes inside the root's scope
    def interceptor(next_fun, args, kwargs, context):
      if context.module.scope is not None and not context.module.path:
        return mark(next_fun)(*args, **kwargs)
      return next_fun(*args, **kwargs)

    with compat.fresh_trace(), nn.intercept_methods(interceptor):
      yield lambda path: path
    return
  renames = getattr(side, 'renames', None)
  to_linen = renames.to_linen if renames is not None else (lambda path: path)
  to_nnx = renames.to_nnx if renames is not None else (lambda path: path)

  def wrap(original):
    marked = mark(original)
    return lambda self, *args, **kwargs: marked(self, *args, **kwargs)

  # The mark patched first, so that the scopes' wrapper, patched over it, names the root outside it.
  with compat.fresh_trace(), scopes.patched_module_calls(sample, wrap), \
      scopes.nnx_module_scopes(sample, to_linen):
    yield to_nnx


def _row_modules(linen_path: str, to_side) -> dict[str, str]:
  """A row's module fields: the side's own path and the Linen path it corresponds to."""
  return {'module': to_side(linen_path) if linen_path else '', 'linen_module': linen_path}


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

  `state`, `batch` and `dropout_base` may be abstract (ShapeDtypeStructs). A recorded side
  (parity/records/) gives the rows it recorded.
  """
  recorded = getattr(side, 'recorded_activations', None)
  if recorded is not None:
    return recorded(mesh_sizes)
  names = sorted({name for name, _ in rules})
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch, dropout_base))
  step = side.train_step_function()
  held = _parameter_names(side)
  if len(names) > NAMED_AXES_AT_ONCE:
    # One mesh axis per name cannot hold a production model's rules (an array has at most
    # 64 axes): a first trace finds the names the step asks for, the mesh takes only those.
    names = sorted(set(_asked(step, abstract, names, held)) & set(names))
  axes = names + sorted(held - set(names))
  if len(axes) > NAMED_AXES_AT_ONCE:
    raise ValueError(f'activation constraints and parameters name {len(axes)} logical axes in one train'
                     f' step; at most {NAMED_AXES_AT_ONCE} can be read at once')
  devices = np.array(jax.devices()[:1]).reshape((1,) * len(axes))  # traced, never run
  mesh = jax.sharding.Mesh(devices, tuple(axes))
  with compat.use_mesh(mesh), nn.logical_axis_rules([(n, n) for n in names]), \
      compat.logical_constraint_names() as asked, _named_modules(side) as to_side:
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
  for index, (site, context, aval, spec, module) in enumerate(found):
    logical = [_names(e) for e in spec] + [None] * (len(aval.shape) - len(spec))
    out.append({
        'index': index,
        'site': site,
        **_row_modules(module, to_side),
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


def _parameter_names(side: Any) -> set[str]:
  """The names of the side's parameter annotations, axes of the mesh its step is traced under."""
  # A model that builds annotated NNX variables inside its step (a Linen module over an NNX
  # one: `nnx.bridge.ToLinen` or a copy of it) places them on the context mesh, by these names.
  names: set[str] = set()
  for spec in getattr(side, 'param_specs', dict)().values():
    for entry in spec:
      names.update(n for n in ((entry,) if isinstance(entry, str) else entry or ()) if isinstance(n, str))
  return names


def _asked(step, abstract, names, held: set[str] = frozenset()) -> list[str]:
  """The logical names the step's constraints ask for (a trace with every name unsharded)."""
  axes = ('parity_names',) + tuple(sorted(held - {'parity_names'}))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), axes)
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
  with context(), _named_modules(side) as to_side:
    jaxpr = jax.make_jaxpr(side.train_step_function())(*abstract)
  found: list[tuple] = []
  _constraints(jaxpr.jaxpr, (), found)
  return [{
      'index': index, 'site': site, **_row_modules(module, to_side), 'context': context,
      'shape': [int(d) for d in aval.shape], 'dtype': np.dtype(aval.dtype).name,
      'logical': [None] * len(aval.shape),
      'physical': [_names(e) for e in spec] + [None] * (len(aval.shape) - len(spec)),
  } for index, (site, context, aval, spec, module) in enumerate(found)]


def _key(row: Row, sites: bool) -> tuple:
  return (row['site'] if sites else None, row['context'], tuple(row['shape']), row['dtype'])


def _module_name(path: str) -> str:
  return path or ROOT


def _module_label(row: Row) -> str:
  """A row's module: its path, and its Linen path where that differs (`layers/0 (Linen layers_0)`)."""
  module = _module_name(row['module'])
  if row.get('linen_module', row['module']) != row['module']:
    module += f" (Linen {_module_name(row['linen_module'])})"
  return module


def where(row: Row) -> str:
  """Where a constraint is: `module layers/mlp, every layer of the scanned stack (#6 Mlp.__call__, jit/scan)`."""
  # A row without a module (made by hand) is named by its number and method alone.
  hint = f"#{row['index']} {row['site']}"
  if 'module' not in row:
    return f"{hint} ({row['context']})"
  module = _module_label(row)
  scanned = ', every layer of the scanned stack' if 'scan' in row['context'].split('/') else ''
  return f"module {module}{scanned} ({hint}, {row['context']})"


def _nnx_where(a: Row, b: Row) -> str:
  """NNX's constraint `b` beside Linen's `a`: its number, and its module where not Linen's."""
  if 'module' not in b or b['module'] == a.get('module'):
    return f"#{b['index']}"
  module = _module_name(b['module'])
  if b.get('linen_module', b['module']) not in (b['module'], a.get('module')):
    module += f" (Linen {_module_name(b['linen_module'])})"
  return f"#{b['index']} in module {module}"


def drift(linen_rows: list[Row], nnx_rows: list[Row], sites: bool = True) -> list[str]:
  """Every constraint that differs between the sides, naming its module and both values.

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
      head, other = where(a), _nnx_where(a, b)
      if _key(a, sites) != _key(b, sites):
        out.append(
            f"{head}: Linen {a['site']} {a['shape']} {a['dtype']} vs NNX {other} {b['site']}"
            f" ({b['context']}) {b['shape']} {b['dtype']}"
        )
      elif a['logical'] != b['logical']:
        out.append(f"{head}: logical Linen {format_names(a['logical'])} vs NNX {other}"
                   f" {format_names(b['logical'])}")
      elif a['physical'] != b['physical']:
        out.append(f"{head}: physical Linen {format_names(a['physical'])} vs NNX {other}"
                   f" {format_names(b['physical'])}")
    for extra, side in ((linen_rows[i1 + len(pairs):i2], 'Linen'), (nnx_rows[j1 + len(pairs):j2], 'NNX')):
      for row in extra:
        out.append(
            f"{where(row)} {row['shape']} {row['dtype']}: only on {side}, logical {format_names(row['logical'])}"
        )
  return out


def format_table(rows: list[Row], modules: bool = False) -> str:
  """One line per constraint, in program order (the golden's format; `modules`: each one's module too)."""
  lines = []
  for r in rows:
    shape = '[' + ','.join(str(d) for d in r['shape']) + ']'
    physical = '' if r['physical'] is None else ' ' + format_names(r['physical'])
    module = ' ' + _module_label(r) if modules and 'module' in r else ''
    lines.append(
        f"{r['index']:04d}{module} {r['site']} {r['context']} {shape} {r['dtype']}"
        f" {format_names(r['logical'])}{physical}\n"
    )
  return ''.join(lines)
