"""The mesh part: the trajectory on a mesh, state shardings and sharding annotations."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import numpy as np

from parity.battery.checks.shared import RefusedDeclaration, _Runs, _battery_frames_hidden, _rules, _runs, compare, first_divergent_step, per_step
from parity.compare import placement as placement_lib
from parity.compare import programs
from parity.core import specs as specs_lib
from parity.pairs import adapter


def check_mesh(pair: adapter.Pair, mesh_spec: str) -> list[str]:
  """Both sides on `mesh_spec`: same shardings and annotations, equal train metrics and final state.

  The placement is checked first: a parameter sharded otherwise on one side
  is the cause of the few-ULP differences it makes in the numbers. Numbers
  that differ come with the programs' sharding annotations where those differ
  too (an activation constrained otherwise changes both); annotations that
  differ where the numbers do not fail last (state one side only carries,
  such as an RNG stream kept in an NNX model).
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  (ma, fa, _), (mb, fb, _) = (runs.trajectory(s, 'linen', mesh_spec) for s in ('linen', 'nnx'))
  linen, nnx_side = runs.sides(mesh_spec)
  drift = state_sharding_drift(fa, fb)
  more = [f'  ... and {len(drift) - 50} more'] if len(drift) > 50 else []
  assert not drift, f'{pair.name}: final state shardings differ on {mesh_spec}:\n' + '\n'.join(drift[:50] + more)
  off = [line for side, f in ((linen, fa), (nnx_side, fb)) for line in _off_their_rules(pair, side, f)]
  assert not off, (
      f'{pair.name}: parameters not where their logical axes and the rules put them on'
      f' {mesh_spec}:\n  ' + '\n  '.join(off[:50])
  )
  batch, key = runs.batch(0, mesh_spec=mesh_spec), runs.dropout_base()
  names, annotations, texts = [], [], {}
  placement = []
  for side in (linen, nnx_side):
    state = side.from_checkpoint(runs.start('linen', mesh_spec))
    placement += getattr(side, 'nnx_only_placement', lambda state: [])(state)
    # As the program part compares them: state only one side keeps left out (its placement
    # checked apart, below), the step counter typed alike.
    compared = side.comparison_state(state)
    lowered = getattr(side, 'lower_for_comparison', side.lower_train_step)(compared, batch, key)
    names.append(set(side.argument_names(lowered, compared, batch, key)))
    annotations.append(programs.sharding_annotations(lowered.as_text()))
    texts['linen' if side is linen else 'nnx'] = lowered.as_text(debug_info=True)
  assert not placement, (f'{pair.name}: state only NNX keeps is not where the side places its state'
                         f' on {mesh_spec}:\n  ' + '\n  '.join(placement))
  a, b = annotations
  try:
    found = compare(pair, 'train', {**per_step(ma), **fa}, {**per_step(mb), **fb},
                    f'{pair.steps} train steps on mesh {mesh_spec}')
  except RefusedDeclaration:  # nothing differs beyond the declarations: nothing to localize
    raise
  except AssertionError as e:
    # Localised on the mesh, where the difference shows: the first module whose output or
    # gradient differs there, and each module whose constraints place intermediates otherwise.
    head, _, leaves = str(e).partition('\n')
    raise AssertionError(
        f'{head}\nlocalizer on {mesh_spec}:\n  '
        + '\n  '.join(_mesh_localization(runs, mesh_spec, first_divergent_step(ma, mb), texts))
        + (f'\nthe sharding annotations of the train steps differ too: only linen {dict(a - b)},'
           f' only nnx {dict(b - a)}' if a != b else '')
        + (f'\n{leaves}' if leaves else '')) from None
  assert a == b, (
      f'{pair.name}: sharding annotations of the train steps differ on {mesh_spec}'
      f' (the train metrics and final state there are bit-identical{", or within the declared bounds" if found else ""}):'
      f' only linen {dict(a - b)}, only nnx {dict(b - a)}'
      + ''.join(f'\n  {line}' for line in placement_lib.differing_modules(
          placement_lib.constraints_by_module(texts['linen']), placement_lib.constraints_by_module(texts['nnx'])))
      + programs.one_sided_arguments(names[0] - names[1], names[1] - names[0])
  )
  return found


def _mesh_localization(runs: '_Runs', mesh_spec: str, step: int, texts: dict[str, str]) -> list[str]:
  """The localizer's report on the mesh at `step`, with the modules placing intermediates otherwise."""
  try:
    result = runs.localization(step, 'linen', mesh_spec)
  except Exception as e:  # the localizer must never hide the failure it explains
    return [f'localizer failed: {type(e).__name__}: {e}']
  mesh = runs.side('linen', mesh_spec).mesh
  return [f'(step {step})'] + result.lines() + placement_lib.mesh_lines(mesh, result.first(step) is None, texts)


def state_sharding_drift(linen: Mapping[str, Any], nnx_state: Mapping[str, Any]) -> list[str]:
  """Each path of two states (checkpoint layout, jax arrays) whose shardings differ in
  mesh, device order or partition spec, as parity.core.specs.sharding_drift tells them
  (`P('fsdp')` and `P('fsdp', None)` of a matrix are one spec; an axis of size 1
  named on one side only still counts as a difference)."""
  shardings = [{p: x.sharding for p, x in f.items()} for f in (linen, nnx_state)]
  ndims = {p: np.ndim(x) for f in (linen, nnx_state) for p, x in f.items()}
  return [str(p) for p in specs_lib.sharding_drift(*shardings, ndims)]


def _off_their_rules(pair: adapter.Pair, side: adapter.Side, flat: Mapping[str, Any]) -> list[str]:
  """Each parameter of `flat` (a state in the checkpoint layout) not where the rules put its axes.

  Catches a side that replicates (or shards otherwise) what its annotations
  say to shard, even when the other side does the same.
  """
  rules = [tuple(r) for r in _rules(pair, side, default=())]
  logical = {r[0] for r in rules}  # then each mesh axis as itself: annotations already resolved
  rules += [(axis, axis) for axis in side.mesh.axis_names if axis not in logical]
  lines = []
  for path, names in side.param_specs().items():
    actual = flat[path].sharding
    target = nn.logical_to_mesh_sharding(jax.sharding.PartitionSpec(*names), side.mesh, rules)
    if specs_lib.sharding_drift({path: target}, {path: actual}, {path: np.ndim(flat[path])}):
      lines.append(f'{side.name} {path}: {specs_lib.describe_sharding(actual)}; its logical axes'
                   f' {names} give {specs_lib.describe_sharding(target)}')
  return lines
