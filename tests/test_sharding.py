"""Both sides on meshes of the 8 CPU devices: shardings, bitwise training, annotations.

For each (scenario, mesh) both sides build their state directly in its target
shardings (jit with output shardings), train the same steps from one state,
and lower their train steps under the same mesh and rules. The tests then ask:

- does every state leaf (parameters and optimizer state) have the same
  sharding on both sides, as created and after training, and is it the one the
  rules give for its logical names?
- are the per-step losses and the final state bitwise equal across sides?
- do both lowered train steps carry the same multiset of sharding annotations
  (argument/result shardings and activation constraints)? A constraint dropped
  or renamed on one side changes no number on CPU; this is where it shows.
- how far is the sharded run from the same run on one device?

Each (scenario, mesh) is trained once per process (`tests.runs.mesh_run`);
tests of one scenario share an xdist group, so they run in one worker.

Matrix (`tests.runs.mesh_cases`): by default the baseline on all four meshes,
the scenarios on the 3-axis mesh `data=2,fsdp=2,tensor=2` except two whose
sharded program another pair covers (`tests.runs.FULL_MATRIX_ONLY` says which
and why), and gradient accumulation with dropout on `fsdp=8` as well: 13
pairs. `--full-mesh-matrix` trains every scenario on every mesh (44 pairs,
about 13 s of compile each when nothing is cached, so it is left out of the
default suite's time budget). The core tier (tests/tiers.py, `make test`) keeps
the baseline on the 3-axis mesh; `make test-all` runs the 13 pairs.
"""
from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from parity.core import specs
from bridge import train_state as bridge_state
from bridge.layout import layout_for
from parity.core.errors import TreeMismatchError
from models.config import get_configs
from parity.battery import checks as battery
from parity.core import bitwise
from bridge import tables
from bridge.sides import make_sides
from tests.runs import MESH_STEPS, THREE_AXES, mesh_cases, mesh_run, tiny_run

def pytest_generate_tests(metafunc):
  if {'scenario', 'mesh'} <= set(metafunc.fixturenames):
    full = metafunc.config.getoption('--full-mesh-matrix')
    metafunc.parametrize(('scenario', 'mesh'), mesh_cases(full))


def _ndims(run_side) -> dict[str, int]:
  return {p: np.ndim(x) for p, x in run_side.final.items()}


def test_state_starts_in_its_target_shardings(scenario, mesh):
  """Linen's init output, and NNX's state carried over from it, are in their targets."""
  run = mesh_run(scenario, mesh)
  for side in (run.linen, run.nnx):
    problems = specs.sharding_drift(side.targets, side.init_shardings, _ndims(side))
    assert not problems, '\n'.join(str(p) for p in problems)


def test_the_steps_take_the_batch_split_as_parity_compare_places_it(scenario, mesh):
  """The mesh tests check the program `parity compare --mesh` runs: its batch split over the
  batch axis (`place_batch`), not a batch on one device that the step would reshard."""
  run = mesh_run(scenario, mesh)
  target = run.side_batch_sharding
  assert target is not None and len(target.device_set) == 8 and not target.is_fully_replicated
  for shardings in run.batch_shardings:  # per side, per batch entry ([batch, seq] arrays)
    assert shardings and all(s.is_equivalent_to(target, 2) for s in shardings.values()), (shardings, target)
  for signature in run.main_signatures:
    arguments = signature.split('(', 1)[1].split(') -> ')[0].split('%arg')[1:]
    unplaced = [a.split(':')[0] for a in arguments if 'sharding' not in a]
    assert len(arguments) > 4 and not unplaced, f'arguments without a sharding: {unplaced}\n{signature[:2000]}'


def test_shardings_identical_across_sides(scenario, mesh):
  run = mesh_run(scenario, mesh)
  ndims = _ndims(run.linen)
  specs.check_same_shardings(run.linen.targets, run.nnx.targets, ndims)
  specs.check_same_shardings(run.linen.shardings, run.nnx.shardings, ndims)
  # Training keeps the state where it was created.
  specs.check_same_shardings(run.linen.targets, run.linen.shardings, ndims)


def test_parameter_shardings_follow_the_rules(scenario, mesh):
  """Each parameter's mesh axes are what the rules give for its Linen logical names.

  Catches a side (or both) silently replicating parameters; optimizer moments
  share their parameter's sharding (checked by the test above, across sides).
  """
  model_cfg, train_cfg = get_configs('tiny', scenario)
  linen, _ = make_sides(model_cfg, train_cfg)
  mesh_sizes = specs.parse_mesh_spec(mesh)
  rows = tables.linen_rows(linen, mesh_sizes=mesh_sizes)
  wrong = tables.placement_mismatches(rows, mesh_run(scenario, mesh).linen.shardings, mesh_sizes)
  assert not wrong, '\n'.join(wrong)
  if mesh_sizes['fsdp'] > 1:
    assert any('fsdp' in str(r['physical']) for r in rows), 'nothing sharded over fsdp'


def test_training_is_bitwise_equal_across_sides(scenario, mesh):
  run = mesh_run(scenario, mesh)
  assert len(run.linen.losses) == MESH_STEPS
  for step, (a, b) in enumerate(zip(run.linen.metrics, run.nnx.metrics)):
    bitwise.assert_bitwise_equal(a, b, f'train metrics at step {step}')
  bitwise.assert_bitwise_equal(run.linen.final, run.nnx.final, 'final state')


def test_lowered_train_steps_carry_the_same_shardings(scenario, mesh):
  """Same multiset of shardings in both lowered train steps.

  Where the layout differs (NNX stacks layers on another axis), the state's
  argument and result shardings differ by that move, which the leaf-by-leaf
  test above checks in the checkpoint layout; here only their number must
  match, and everything inside the program must be the same.
  """
  run = mesh_run(scenario, mesh)
  linen, nnx_ = run.linen.annotations, run.nnx.annotations
  # Arguments, results and activation constraints: far more than the state alone.
  assert sum(linen.values()) > 2 * len(run.linen.final)
  assert sum(v for k, v in linen.items() if not k.startswith('signature')) > 0, (
      'no sharding constraint inside the Linen train step'
  )
  if layout_for(get_configs('tiny', scenario)[0]).moves:
    signature = lambda c: sum(v for k, v in c.items() if k.startswith('signature'))
    assert signature(linen) == signature(nnx_)
    linen = collections.Counter({k: v for k, v in linen.items() if not k.startswith('signature')})
    nnx_ = collections.Counter({k: v for k, v in nnx_.items() if not k.startswith('signature')})
  only_linen, only_nnx = linen - nnx_, nnx_ - linen
  assert not only_linen and not only_nnx, (
      'sharding annotations differ between the lowered train steps\n'
      f'only in Linen (annotation: extra count): {dict(only_linen)}\n'
      f'only in NNX: {dict(only_nnx)}'
  )


@pytest.mark.exhaustive
def test_nnx_init_creates_its_state_in_the_target_shardings():
  """NNX's own initialiser (the runs above start NNX from Linen's state)."""
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  _, nnx_side = make_sides(model_cfg, train_cfg, specs.make_mesh(THREE_AXES))
  state = nnx_side.init(0)
  actual = bridge_state.nnx_to_checkpoint_leaves(
      jax.tree.map(lambda x: x.sharding, state), nnx_side.layout
  )
  ndims = {p: len(x.shape) for p, x in nnx_side.abstract_checkpoint().items()}
  specs.check_same_shardings(nnx_side.checkpoint_shardings(), actual, ndims)


# Sharded vs one device. XLA splits each contraction over the sharded axes and
# adds the partial sums across devices, so sums are taken in another order than
# on one device; activations are bfloat16, so a different order can flip a
# rounding (relative step 2**-8). The loss is a mean over all tokens, which
# averages those flips: measured over the 3 steps, 3e-5 to 1.5e-4 relative
# (baseline and dropout, fsdp=8 and the 3-axis mesh; it grows as the parameters
# drift apart). The bound is a quarter of a bfloat16 ulp, 2**-10 relative: above
# what reordering gives, far below a real bug (a dropped mask, a wrong shard).
LOSS_BOUND = 2.0**-10


def test_sharded_losses_match_one_device_within_bound(scenario, mesh):
  sharded = [float(x) for x in mesh_run(scenario, mesh).linen.losses]
  single = tiny_run(scenario).linen.losses[:MESH_STEPS]
  relative = [abs(a - b) / abs(b) for a, b in zip(sharded, single)]
  assert max(relative) <= LOSS_BOUND, (
      f'sharded {sharded} vs one device {single}: relative {relative}'
  )
  # Equal bits would mean the mesh did nothing: say so if that ever happens.
  assert [np.float32(x).tobytes() for x in sharded] != [
      np.float32(x).tobytes() for x in single
  ], 'sharded run bitwise equal to one device: is the mesh in effect?'


# ---------------------------------------------------------------------------
# Rules, drift reports and mesh specs: eval_shape only
# ---------------------------------------------------------------------------


def _target_params(side, path_prefix='params/params/'):
  return {p: s for p, s in side.checkpoint_shardings().items() if p.startswith(path_prefix)}


def test_user_rules_are_followed_by_both_sides():
  """Swap the MLP's axes: `mlp` over `fsdp` and `embed` over `tensor`."""
  custom = tuple(
      ('mlp', 'fsdp') if name == 'mlp' else ('embed', 'tensor') if name == 'embed' else (name, axes)
      for name, axes in specs.DEFAULT_RULES
  )
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  mesh = specs.make_mesh('fsdp=4,tensor=2')
  default_linen, _ = make_sides(model_cfg, train_cfg, mesh)
  linen, nnx_side = make_sides(model_cfg, train_cfg, mesh, custom)
  ndims = {p: len(x.shape) for p, x in linen.abstract_checkpoint().items()}
  specs.check_same_shardings(linen.checkpoint_shardings(), nnx_side.checkpoint_shardings(), ndims)
  wo = 'params/params/decoder/layers/mlp/wo/kernel'
  for side in (linen, nnx_side):
    assert tuple(side.checkpoint_shardings()[wo].spec) == ('fsdp', None, 'tensor')
    # Adam's moments follow their parameter.
    assert tuple(side.checkpoint_shardings()['opt_state/1/0/mu/params/decoder/layers/mlp/wo/kernel'].spec) == ('fsdp', None, 'tensor')
  assert tuple(default_linen.checkpoint_shardings()[wo].spec) == ('tensor', None, 'fsdp')


def test_sharding_drift_names_the_parameter_and_both_shardings():
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  linen, nnx_side = make_sides(model_cfg, train_cfg, specs.make_mesh('fsdp=4,tensor=2'))
  ndims = {p: len(x.shape) for p, x in linen.abstract_checkpoint().items()}
  broken = dict(nnx_side.checkpoint_shardings())
  path = 'params/params/decoder/logits_dense/kernel'
  replicated = broken[path].update(spec=())
  broken[path] = replicated
  with pytest.raises(TreeMismatchError) as info:
    specs.check_same_shardings(linen.checkpoint_shardings(), broken, ndims)
  assert str(info.value).splitlines() == [
      'shardings differ between Linen and NNX: 1 path(s) do not match:',
      f"  {path}: sharding: expected P('fsdp', 'tensor') on data=1,fsdp=4,tensor=2 (Linen),"
      ' got P() on data=1,fsdp=4,tensor=2 (NNX)',
  ]


def test_the_plugins_mesh_part_compares_placements_not_their_printing():
  """Two specs of one placement are equal; one spec on the devices in another order is not."""
  devices = np.array(jax.devices()[:8])
  mesh, flipped = (jax.sharding.Mesh(d, ('fsdp',)) for d in (devices, devices[::-1]))
  x = np.zeros((8, 4), np.float32)

  def put(m, *spec):
    return {'w': jax.device_put(x, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec(*spec)))}

  assert battery.state_sharding_drift(put(mesh, 'fsdp'), put(mesh, 'fsdp', None)) == []
  ids = [d.id for d in devices]
  assert battery.state_sharding_drift(put(mesh, 'fsdp'), put(flipped, 'fsdp')) == [
      f"  w: sharding: expected P('fsdp') on fsdp=8 (devices {ids}) (Linen),"
      f" got P('fsdp') on fsdp=8 (devices {ids[::-1]}) (NNX)"
  ]


@pytest.mark.parametrize('spec, message', [
    ('fsdp=4', "mesh 'fsdp=4' needs 4 devices, but 8 are available"),
    ('fsdp=4,tensor=4', "mesh 'fsdp=4,tensor=4' needs 16 devices, but 8 are available"),
    ('fsdp=8,mo-del=1', "got 'mo-del=1'"),
    ('fsdp=x', "got 'fsdp=x'"),
    ('fsdp=4,fsdp=2', "axis 'fsdp' given twice"),
])
def test_bad_mesh_spec_is_one_clear_error(spec, message):
  with pytest.raises(ValueError) as info:
    specs.make_mesh(spec)
  assert message in str(info.value)


def test_a_mesh_spec_may_name_a_models_own_axes():
  """Axes beyond the kit's three (a production model's `stage`, `sequence`, ...) follow them."""
  mesh = specs.make_mesh('fsdp=2,stage=1,sequence=2,tensor=2')
  assert mesh.axis_names == ('data', 'fsdp', 'tensor', 'stage', 'sequence')
  assert dict(mesh.shape) == {'data': 1, 'fsdp': 2, 'tensor': 2, 'stage': 1, 'sequence': 2}
