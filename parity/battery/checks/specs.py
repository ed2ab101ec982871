"""The specs part: logical and physical parameter specs, and activation constraints."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from parity.battery.checks.shared import _battery_frames_hidden, _rules, _runs
from parity.compare import activations
from parity.core import rng
from parity.core import specs as specs_lib
from parity.core.errors import TreeMismatchError
from parity.pairs import adapter


def check_specs(pair: adapter.Pair) -> list[str]:
  """Logical specs of the parameters, and of every activation constraint of the train steps.

  The activation constraints are read from each side's traced train step
  (parity/compare/activations.py: traced under a mesh named by the rules' logical
  names, so each constraint spells the names it was given): the same
  number, in the same program order and control flow, with the same shapes,
  dtypes and logical names. The model methods applying them may be named
  differently on each side; a constraint that differs is named by the module
  it is in. Returns a line saying how many were compared.
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  linen, nnx_side = runs.sides()
  notes = check_param_specs(pair, linen, nnx_side)
  if pair.activations_resolved:  # declared: no logical names to read, the physical specs compared
    return notes + _check_resolved_activations(pair, None)
  start = runs.start('linen')
  tables = activation_tables(pair, (linen, nnx_side), [side.from_checkpoint(start) for side in (linen, nnx_side)],
                             runs.batch(0), runs.dropout_base())
  return notes + check_activation_tables(pair, tables)


def activation_tables(pair: adapter.Pair, sides: Sequence[adapter.Side], states: Sequence[Any], batch: Any,
                      dropout_base: Any, mesh_sizes: Mapping[str, int] | None = None) -> tuple[list, list]:
  """Both train steps' activation constraints under the pair's rules (inputs may be abstract)."""
  # `mesh_sizes`: their physical specs on a mesh of those sizes too. A model that constrains
  # with mesh axes fails, saying how to declare it.
  rules = _rules(pair, sides[0], default=specs_lib.DEFAULT_RULES)
  try:
    return tuple(activations.rows(side, state, batch, dropout_base, tuple(rules), mesh_sizes=mesh_sizes)
                 for side, state in zip(sides, states))
  except ValueError as e:
    if 'not found in mesh' not in str(e):
      raise
    raise AssertionError(
        f'{pair.name}: activation constraints name mesh axes, not logical names ({e}): the model'
        ' resolves its names itself. Declare it, Pair(activations_resolved=True), to compare the'
        ' physical specs they resolve to on each mesh of the pair') from None


def check_activation_tables(pair: adapter.Pair, tables: Sequence[list]) -> list[str]:
  """The specs part's verdict on both sides' activation constraints: a line, or AssertionError."""
  # Each constraint that differs is named by its module; constraints with no logical name go
  # to `_check_resolved_activations`.
  problems = activations.drift(*tables, sites=False)
  if problems:
    raise AssertionError(
        f'{pair.name}: activation constraints differ ({len(tables[0])} in Linen\'s train step,'
        f' {len(tables[1])} in NNX\'s):\n  ' + '\n  '.join(problems[:50])
    )
  if not tables[0]:
    return ['activation constraints: none in either train step (nothing to compare)']
  if activations.unnamed(tables[0]) and activations.unnamed(tables[1]):
    return _check_resolved_activations(pair, len(tables[0]))
  return [f'activation constraints: {len(tables[0])} per train step, the same logical names on both sides']


def _check_resolved_activations(pair: adapter.Pair, count: int | None) -> list[str]:
  """Constraints that carry no logical name on either side: never a silent pass. Declared
  (`Pair(activations_resolved=True)`), their physical specs are compared on each mesh."""
  if not pair.activations_resolved:
    raise AssertionError(
        f'{pair.name}: nothing compared: the {count} activation constraints of each train step carry'
        ' no logical name on either side (the model resolves its names to mesh axes before it'
        ' constrains, or constrains with mesh axes), so a renamed activation axis would go unseen.'
        ' Constrain with logical names (nn.with_logical_constraint under the rules), or declare'
        ' that the model resolves them itself, Pair(activations_resolved=True): the part then'
        ' compares the physical specs they resolve to on each mesh of the pair')
  lines = []
  for spec in pair.meshes:
    tables = resolved_activation_tables(pair, spec)
    problems = activations.drift(*tables, sites=False)
    if problems:
      raise AssertionError(
          f'{pair.name}: activation constraints resolve to other mesh axes on {spec} (the model'
          f' resolves its names itself: Pair(activations_resolved=True)):\n  ' + '\n  '.join(problems[:50]))
    if not tables[0]:
      raise AssertionError(f'{pair.name}: nothing compared: no activation constraint in either train'
                           f' step on {spec}, though the pair declares activations_resolved')
    lines.append(f'activation constraints: {len(tables[0])} per train step, resolved by the model itself'
                 f' (declared), the same physical specs on {spec}')
  return lines


def resolved_activation_tables(pair: adapter.Pair, spec: str) -> tuple[list, list]:
  """Both train steps' activation constraints as each side's own mesh (`spec`) and rules resolve them."""
  sides = adapter.make_pair_sides(pair, pair.mesh(spec))
  start = sides[0].init(pair.seed)
  batch = sides[0].place_batch(pair.batch(0, 'train'))
  base = rng.base_key(pair.seed)
  return tuple(activations.physical_rows(side, side.from_checkpoint(sides[0].to_checkpoint(start)), batch, base)
               for side in sides)


def check_param_specs(pair: adapter.Pair, linen: adapter.Side, nnx_side: adapter.Side) -> list[str]:
  """The parameters' annotations, equal as written; or, where one side annotates with logical
  names and the other with mesh axes (already resolved by its own rules), equal in placement
  on every mesh of the pair. Returns a line saying which."""
  linen_specs, nnx_specs = linen.param_specs(), nnx_side.param_specs()
  problems = specs_lib.spec_drift(linen_specs, nnx_specs, f'{pair.name} parameters')
  if not problems:
    return []
  rules = tuple(tuple(r) for r in (_rules(pair, linen, default=()) or ()))
  meshes = {m: specs_lib.parse_mesh_spec(m) for m in pair.meshes}
  axes = sorted(set().union(*meshes.values())) if meshes else []
  kinds = (specs_lib.convention(linen_specs, rules, axes), specs_lib.convention(nnx_specs, rules, axes))
  same_paths = set(linen_specs) == set(nnx_specs)
  if not same_paths or kinds[0] == kinds[1] or 'mixed' in kinds or not meshes:
    # With no rules, a name that is no mesh axis reads as nothing: logical names, with the rules missing.
    unread = [sorted({name for spec in side.values() for entry in spec
                      for name in (entry if isinstance(entry, (tuple, list)) else (entry,))
                      if name is not None} - set(axes)) if not rules else []
              for side in (linen_specs, nnx_specs)]
    shown = [f'logical names ({", ".join(names)}), but no rules were given to read them' if names else kind
             for kind, names in zip(kinds, unread)]
    advice = ('; give the pair the logical axis rules the annotations are written against:'
              ' parity.Pair(..., rules=RULES) (the stock sides take rules= too; docs/howto-mesh.md,'
              ' "Meshes and logical axis rules")') if any(unread) else ''
    raise AssertionError(str(TreeMismatchError(f'{pair.name} parameters specs differ between Linen and NNX'
                                               f' (Linen annotates with {shown[0]}, NNX with {shown[1]}{advice})',
                                               problems)))
  drift = specs_lib.placement_drift(linen_specs, nnx_specs, kinds, rules, meshes)
  if drift:
    raise AssertionError(str(TreeMismatchError(
        f'{pair.name} parameters are placed otherwise (Linen annotates with {kinds[0]}, NNX with'
        f' {kinds[1]}; each read in its own convention with the pair\'s rules)', drift)))
  return [f'parameter specs: Linen annotates with {kinds[0]}, NNX with {kinds[1]}; the placements agree'
          f' on {", ".join(meshes)} ({len(linen_specs)} parameters)']
