"""`parity specs --pair FILE.py:NAME`: a declared pair's parameter (or activation-constraint) tables.

Both sides' tables as the battery's specs part reads them (parity/battery/checks/specs.py):
the parameters' shapes, dtypes and annotations from each side (`abstract_checkpoint`,
`param_specs`: eval_shape, nothing allocated), placed on a mesh of the spec's sizes by
the pair's rules; or every activation constraint of both train steps
(parity/compare/activations.py: traced, nothing compiled). The differences are the specs
part's. Exit status: 0 equal, 1 different, 2 bad input (raised as `BadInput`).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np

from parity.core import rng
from parity.core import specs
from parity.core.errors import BadInput, TreeMismatchError
from parity.pairs import adapter

Row = dict[str, Any]


def _mesh_sizes(pair: adapter.Pair, spec: str | None) -> dict[str, int] | None:
  """The axis sizes of the mesh the tables place on (None: one device)."""
  if spec is None:
    return None
  try:
    return specs.parse_mesh_spec(spec)
  except ValueError as e:
    raise BadInput(f'--mesh {spec}: {e}' if spec not in pair.meshes else f'{pair.name} meshes: {e}') from None


def param_rows(side: adapter.Side, rules, mesh_sizes: Mapping[str, int] | None) -> list[Row]:
  """One row per parameter of `side`: checkpoint path, shape, dtype, annotation, placement."""
  abstract = side.abstract_checkpoint()
  annotations = {p: tuple(s) for p, s in side.param_specs().items()}
  # Each side's annotations read in their own convention, as the specs part reads them.
  kind = specs.convention(annotations, rules, list(mesh_sizes or ()))
  renames = getattr(side, 'renames', None) if side.name == 'nnx' else None
  out = []
  for path in sorted(p for p in abstract if p.startswith('params/')):
    shape = [int(d) for d in abstract[path].shape]
    names = annotations.get(path, ())
    row = {'path': path, 'shape': shape, 'dtype': np.dtype(abstract[path].dtype).name,
           'logical': _listed(names), 'physical': None, 'convention': kind}
    module = path[len('params/'):]
    if renames is not None and renames.to_nnx(module) != module:
      row['nnx_path'] = 'params/' + renames.to_nnx(module)
    if mesh_sizes is not None:
      placed = tuple(specs.placement(names, kind, rules, mesh_sizes)) if names else ()
      row['physical'] = _listed(placed + (None,) * (len(shape) - len(placed)))
    out.append(row)
  return out


def _listed(entries) -> list:
  """A spec as the JSON holds it: a list, an entry of several axes a list too."""
  return [list(e) if isinstance(e, tuple) else e for e in entries]


_LABELS = {'mesh axes': 'mesh_axes', 'mixed': 'annotated'}


def format_params(rows: list[Row]) -> str:
  """One line per parameter: path (NNX's own where it differs), dtype[shape], logical, physical."""
  lines = []
  for row in rows:
    own = f" (NNX {row['nnx_path']})" if 'nnx_path' in row else ''
    # The annotation under the name of what it holds: logical names, or mesh axes already resolved
    # (a side annotating with mesh axes has no logical names to show).
    label = _LABELS.get(row.get('convention'), 'logical')
    line = (f"{row['path']}{own} {row['dtype']}[{','.join(str(d) for d in row['shape'])}]"
            f" {label}={specs.format_names(row['logical'])}")
    if row['physical'] is not None:
      line += f" physical={specs.format_names(row['physical'])}"
    lines.append(line + '\n')
  return ''.join(lines)


def structure_drift(linen: list[Row], nnx_rows: list[Row]) -> list[str]:
  """Each parameter on one side only, or of another shape or dtype."""
  a, b = ({r['path']: r for r in rows} for rows in (linen, nnx_rows))
  out = []
  for path in sorted(set(a) | set(b)):
    if path not in a or path not in b:
      out.append(f'{path}: only on {"NNX" if path not in a else "Linen"}')
      continue
    for key in ('shape', 'dtype'):
      if a[path][key] != b[path][key]:
        out.append(f'{path}: {key} Linen {a[path][key]} vs NNX {b[path][key]}')
  return out


def _abstract_state(side: adapter.Side) -> Any:
  """A side's train state as shapes only: its `template` where it has one (the stock sides)."""
  template = getattr(side, 'template', None)
  return template if template is not None else side.from_checkpoint(side.abstract_checkpoint())


def _param_tables(pair, sides, spec, mesh_sizes) -> tuple[list[Row], list[Row], list[str], list[str]]:
  """(Linen rows, NNX rows, differences, notes) of the parameters, as the specs part compares them."""
  from parity.battery import checks

  rules = tuple(tuple(r) for r in (checks._rules(pair, sides[0], default=()) or ()))
  tables = [param_rows(side, rules, mesh_sizes) for side in sides]
  problems = structure_drift(*tables)
  # The specs part's comparison, its placements on the mesh shown (where the sides annotate
  # in two conventions).
  on_mesh = dataclasses.replace(pair, meshes=(spec,) if spec else ())
  notes = []
  try:
    notes = checks.check_param_specs(on_mesh, *sides)
  except AssertionError as e:  # its headline (the conventions), then a line per parameter
    headline, *lines = str(e).splitlines()
    notes, problems = [headline], problems + [line.strip() for line in lines]
  return *tables, problems, notes


def _activation_tables(pair, sides, spec, mesh_sizes) -> tuple[list[Row], list[Row], list[str], list[str]]:
  """(Linen rows, NNX rows, differences, notes) of the activation constraints, as the specs part compares them."""
  # Their logical names; declared `activations_resolved`, the physical specs on `spec`.
  from parity.battery import checks
  from parity.compare import activations

  if pair.activations_resolved:
    if spec is None:
      raise BadInput(f'{pair.name} declares activations_resolved: its constraints are compared on a mesh;'
                     ' give one (--mesh)')
    try:
      tables = checks.resolved_activation_tables(pair, spec)
    except ValueError as e:  # a mesh the devices cannot make
      raise BadInput(f'--mesh {spec}: {e}') from None
    return (*tables, activations.drift(*tables, sites=False),
            [f'resolved by the model itself (declared): physical specs on {spec}'])
  batch = pair.batch(0, 'train')
  try:
    tables = checks.activation_tables(pair, sides, [_abstract_state(s) for s in sides], batch,
                                      rng.base_key(pair.seed), mesh_sizes)
  except ValueError as e:  # a logical name the rules do not know
    raise BadInput(f'{pair.name}: {e}') from None
  except AssertionError as e:  # mesh axes, not logical names, and not declared
    return [], [], [str(e)], []
  try:
    notes = checks.check_activation_tables(pair, tables)
  except AssertionError as e:
    problems = activations.drift(*tables, sites=False) or [str(e)]
    return *tables, problems, []
  return *tables, [], notes


def command(args, pair: adapter.Pair) -> int:
  """`parity specs --pair`: prints both tables and the differences; 0 equal, 1 different."""
  from parity.compare import activations

  if (args.preset, args.scenario) != (None, None):
    raise BadInput("--preset and --scenario choose the reference decoder's configuration;"
                   ' a --pair brings its own model')
  spec = args.mesh or (pair.meshes[0] if pair.meshes else None)
  mesh_sizes = _mesh_sizes(pair, spec)
  try:
    sides = adapter.make_pair_sides(pair, None)
  except (adapter.BatchError, adapter.SideError) as e:
    raise BadInput(str(e)) from None
  if args.activations:
    linen_rows, nnx_rows, problems, notes = _activation_tables(pair, sides, spec, mesh_sizes)
    what, extra = 'activation specs', {}
    heading = 'activation constraints of the train step, in program order (traced, nothing compiled)'
    format_table = lambda rows: activations.format_table(rows, modules=True)  # noqa: E731
  else:
    try:
      linen_rows, nnx_rows, problems, notes = _param_tables(pair, sides, spec, mesh_sizes)
    except TreeMismatchError as e:  # a state the checkpoint layout cannot hold: the structure part's
      print(f'{e}\nverdict: STATES DIFFER (no specs compared)')
      return 1
    count = int(sum(int(np.prod(r['shape'])) for r in linen_rows))
    what, extra = 'specs', {'param_count': count}
    heading = f'{len(linen_rows)} parameters, {count:,} values (eval_shape, nothing allocated)'
    format_table = format_params
  if args.format == 'json':
    print(json.dumps({'pair': pair.name, 'mesh': spec, **extra, 'equal': not problems,
                      'differences': problems, 'notes': notes, 'linen': linen_rows, 'nnx': nnx_rows}, indent=1))
  else:
    where = f'mesh {spec}' if spec else 'one device'
    print(f'pair {pair.name}, {where}: {heading}')
    for name, rows in (('Linen', linen_rows), ('NNX', nnx_rows)):
      print(f'\n{name}:')
      print(format_table(rows), end='')
    print()
    for note in notes:
      print(note)
    if problems:
      print(f'{what} differ between Linen and NNX ({len(problems)}):')
      for line in problems:
        print(f'  {line}')
    else:
      print(f'{what} equal on both sides')
  return 1 if problems else 0
