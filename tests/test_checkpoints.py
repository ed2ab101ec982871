"""Orbax checkpoints: round trips in all four directions, resume parity, resharding restore.

Resume protocol (as other frameworks test resumes): an uninterrupted 10-step
Linen run is the reference; for every (X, Y) in {Linen, NNX}^2, side X trains
steps 0-4 from the same initial state and saves at step 5 (asynchronously,
while the reference keeps training the very state it saved), side Y restores
it with the saved dropout base key and trains steps 5-9. Per-step losses and
the final state must equal the reference bit for bit. The scenario is
`06_grad_accum`: dropout 0.1 (the key stream must continue, not restart) and
4 microbatches. It runs on one device and on an fsdp=8 mesh, all four pairs
on both; the step-5 checkpoints double as the round-trip checkpoints.

Round trips also run on random bit patterns (NaN payloads and -0.0 included)
in `10_scan_axis0` on fsdp=8, where the NNX side stacks layers on another
axis (and shards them accordingly) and must still write the Linen layout. Resharding restores the fsdp=8 checkpoints onto
a data=2,fsdp=2,tensor=2 mesh and onto one device; Orbax is given each
array's target sharding, so it reads every shard's box directly and never
builds the unsharded array first.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
import pytest

from parity.core import specs
from parity.core.errors import TreeMismatchError
from parity.core import paths
from models import data, rng
from models.config import get_configs, replace
from parity.store import checkpoints as ck
from parity.core.bitwise import assert_bitwise_equal
from bridge.sides import as_jax_batch, make_sides

# Same worker as 06_grad_accum's other tests: its compiled steps are shared.
pytestmark = pytest.mark.xdist_group('06_grad_accum')

RESUME_SCENARIO = '06_grad_accum'
STEPS = 10
SAVE_AT = 5
SIDES = ('linen', 'nnx')
PAIRS = [(x, y) for x in SIDES for y in SIDES]
PAIR_IDS = [f'{x}->{y}' for x, y in PAIRS]
PLACEMENTS = [None, 'fsdp=8']
PLACEMENT_IDS = ['one_device', 'fsdp8']
RESHARD_MESH = 'data=2,fsdp=2,tensor=2'


@dataclasses.dataclass
class Restored:
  flat: dict[str, jax.Array]  # as restored, checkpoint layout
  dropout_base: jax.Array
  state: Any  # the restoring side's train state


@dataclasses.dataclass
class ResumeRuns:
  sides: dict[str, Any]
  managers: dict[str, Any]  # the saving side's CheckpointManager
  dropout_base: jax.Array
  saved: dict[str, dict[str, jax.Array]]  # what side X saved at step 5
  reference_losses: list[jax.Array]
  reference_final: dict[str, jax.Array]
  prefix_losses: dict[str, list[jax.Array]]
  restored: dict[tuple[str, str], Restored]
  resumed_losses: dict[tuple[str, str], list[jax.Array]]
  resumed_final: dict[tuple[str, str], dict[str, jax.Array]]


def _train(side, state, batches, dropout_base):
  losses = []
  for batch in batches:
    state, metrics = side.train_step(state, batch, dropout_base)
    losses.append(metrics['loss'])
  return state, losses


@functools.cache
def _initial_state() -> dict[str, jax.Array]:
  """Linen's initial state on one device, in the checkpoint layout (one init for all meshes)."""
  linen, _ = make_sides(*get_configs('tiny', RESUME_SCENARIO))
  return linen.to_checkpoint(linen.init(0))


def _target_shardings(side) -> dict[str, jax.sharding.Sharding]:
  if side.mesh is None:
    return {p: jax.sharding.SingleDeviceSharding(jax.devices()[0]) for p in side.abstract_checkpoint()}
  return side.checkpoint_shardings()


def _resume_runs(mesh_spec: str | None, root) -> ResumeRuns:
  model_cfg, train_cfg = get_configs('tiny', RESUME_SCENARIO)
  mesh = None if mesh_spec is None else specs.make_mesh(mesh_spec)
  linen, nnx_side = make_sides(model_cfg, train_cfg, mesh)
  sides = {'linen': linen, 'nnx': nnx_side}
  batches = [as_jax_batch(data.make_batch(model_cfg, train_cfg, s)) for s in range(STEPS)]
  # Placed as tests/runs.mesh_run and the battery place theirs (and as
  # `parity compare` does), so the steps are the programs they compile: on a
  # mesh the state in its shardings and the key replicated (as restored); on
  # one device neither is committed (as `checkpoints.restore` returns them).
  initial = _initial_state() if mesh is None else jax.device_put(_initial_state(), _target_shardings(linen))
  base = rng.base_key(0) if mesh is None else jax.device_put(rng.base_key(0), ck.key_sharding(mesh))

  managers, saved, prefix_losses, live = {}, {}, {}, {}
  for name, side in sides.items():
    state, prefix_losses[name] = _train(side, side.from_checkpoint(initial), batches[:SAVE_AT], base)
    managers[name] = ck.open_manager(root / name)
    ck.save(managers[name], SAVE_AT, side, state, base)
    saved[name] = side.to_checkpoint(state)
    live[name] = state

  # The reference trains on while its step-5 save is still being written.
  final, rest = _train(linen, live['linen'], batches[SAVE_AT:], base)
  runs = ResumeRuns(
      sides, managers, base, saved, prefix_losses['linen'] + rest, linen.to_checkpoint(final),
      prefix_losses, {}, {}, {},
  )
  for x, y in PAIRS:
    flat, restored_base = ck.restore_checkpoint(managers[x], SAVE_AT, sides[y])
    # The train state as resuming gets it (`checkpoints.restore`: on one
    # device not committed, so the step is the one that trained before).
    state, resume_base = ck.restore(managers[x], SAVE_AT, sides[y])
    runs.restored[x, y] = Restored(flat, restored_base, state)
    final, runs.resumed_losses[x, y] = _train(sides[y], state, batches[SAVE_AT:], resume_base)
    runs.resumed_final[x, y] = sides[y].to_checkpoint(final)
  return runs


@pytest.fixture(scope='module')
def resume_runs(tmp_path_factory):
  cache = {}

  def get(mesh_spec: str | None) -> ResumeRuns:
    if mesh_spec not in cache:
      cache[mesh_spec] = _resume_runs(mesh_spec, tmp_path_factory.mktemp('resume'))
    return cache[mesh_spec]

  yield get
  for runs in cache.values():
    for manager in runs.managers.values():
      manager.close()


def _shardings(tree: Any) -> dict[str, Any]:
  return {p: x.sharding for p, x in paths.flatten(tree).items()}


def _assert_placed_as_asked(side, restored: Restored) -> None:
  """Restored arrays sit where the restoring side's own state would."""
  if side.mesh is None:
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for what, tree in (('checkpoint', restored.flat), ('state', restored.state)):
      wrong = {p: s for p, s in _shardings(tree).items() if s != one_device}
      assert not wrong, f'{what} leaves not on {one_device}: {wrong}'
    return
  got, want = _shardings(restored.flat), side.checkpoint_shardings()
  wrong = {p: (got[p], want[p]) for p in want if got.get(p) != want[p]}
  assert not wrong, f'restored checkpoint arrays (got, asked for): {wrong}'
  got, want = _shardings(restored.state), paths.flatten(side.state_shardings)
  wrong = {p: (got[p], want[p]) for p in want if got.get(p) != want[p]}
  assert not wrong, f'restored state leaves (got, asked for): {wrong}'


@pytest.mark.parametrize('mesh_spec', PLACEMENTS, ids=PLACEMENT_IDS)
@pytest.mark.parametrize('x,y', PAIRS, ids=PAIR_IDS)
def test_round_trip(resume_runs, mesh_spec, x, y):
  runs = resume_runs(mesh_spec)
  restored = runs.restored[x, y]
  assert_bitwise_equal(runs.saved[x], restored.flat, f'{x} saved vs restored for {y}')
  assert_bitwise_equal(
      runs.saved[x], runs.sides[y].to_checkpoint(restored.state), f'{x} saved vs {y} state'
  )
  assert_bitwise_equal(runs.dropout_base, restored.dropout_base, 'dropout base key')
  _assert_placed_as_asked(runs.sides[y], restored)


@pytest.mark.parametrize('mesh_spec', PLACEMENTS, ids=PLACEMENT_IDS)
@pytest.mark.parametrize('x,y', PAIRS, ids=PAIR_IDS)
def test_resume_parity(resume_runs, mesh_spec, x, y):
  runs = resume_runs(mesh_spec)
  assert_bitwise_equal(
      runs.reference_losses[:SAVE_AT], runs.prefix_losses[x], f'losses of steps 0-4 ({x})'
  )
  assert_bitwise_equal(
      runs.reference_losses[SAVE_AT:], runs.resumed_losses[x, y],
      f'losses of steps 5-9 (saved by {x}, resumed by {y})',
  )
  assert_bitwise_equal(runs.reference_final, runs.resumed_final[x, y], 'final state')


def _random_bits(abstract: dict[str, jax.ShapeDtypeStruct], seed: int) -> dict[str, np.ndarray]:
  """Every leaf filled with random bit patterns (NaN payloads, -0.0, subnormals)."""
  gen = np.random.default_rng(seed)
  out = {}
  for path, leaf in abstract.items():
    dtype = np.dtype(leaf.dtype)
    if path == 'step':
      out[path] = np.asarray(SAVE_AT, dtype)
      continue
    bits = gen.integers(0, 2 ** (8 * dtype.itemsize), size=leaf.shape, dtype=f'u{dtype.itemsize}')
    out[path] = bits.view(dtype)
  return out


def test_round_trip_random_bits_with_layout_move(tmp_path):
  """On fsdp=8 only: one device adds nothing here that the resume runs do not cover."""
  mesh = specs.make_mesh('fsdp=8')
  sides = dict(zip(SIDES, make_sides(*get_configs('tiny', '10_scan_axis0'), mesh)))
  flat = _random_bits(sides['linen'].abstract_checkpoint(), seed=1)
  key = rng.base_key(7)
  assert any(np.isnan(x).any() for x in flat.values() if x.dtype.kind == 'f')
  for x in SIDES:
    manager = ck.open_manager(tmp_path / x)
    ck.save(manager, SAVE_AT, sides[x], sides[x].from_checkpoint(flat), key)
    for y in SIDES:
      restored = Restored(*ck.restore_checkpoint(manager, SAVE_AT, sides[y]), None)
      restored.state = sides[y].from_checkpoint(restored.flat)
      assert_bitwise_equal(flat, restored.flat, f'{x} -> {y} restored arrays')
      assert_bitwise_equal(flat, sides[y].to_checkpoint(restored.state), f'{x} -> {y} state')
      assert_bitwise_equal(key, restored.dropout_base, 'dropout base key')
      _assert_placed_as_asked(sides[y], restored)
    manager.close()


@functools.cache
def _reshard_sides(mesh_spec: str):
  return dict(zip(SIDES, make_sides(*get_configs('tiny', RESUME_SCENARIO), specs.make_mesh(mesh_spec))))


@pytest.mark.parametrize('target', [RESHARD_MESH, None], ids=['data2_fsdp2_tensor2', 'one_device'])
@pytest.mark.parametrize('x,y', PAIRS, ids=PAIR_IDS)
def test_resharding_restore(resume_runs, target, x, y):
  """Saved on fsdp=8, restored onto another mesh or one device."""
  saved_on = resume_runs('fsdp=8')
  side = resume_runs(None).sides[y] if target is None else _reshard_sides(target)[y]
  flat, key = ck.restore_checkpoint(saved_on.managers[x], SAVE_AT, side)
  restored = Restored(flat, key, side.from_checkpoint(flat))
  assert_bitwise_equal(saved_on.saved[x], restored.flat, f'{x} on fsdp=8 -> {y} on {target}')
  assert_bitwise_equal(saved_on.saved[x], side.to_checkpoint(restored.state), 'restored state')
  _assert_placed_as_asked(side, restored)


MISMATCHED = {
    # The checkpoint's decoder/layers/... are absent from an unscanned model,
    # whose decoder/layers_0/... are absent from the checkpoint; bf16 weights.
    'unscanned_bf16': ({'scan_layers': False, 'weight_dtype': 'bfloat16'}, [
        'params/params/decoder/layers/mlp/wi_0/kernel: extra',
        'params/params/decoder/layers_0/mlp/wi_0/kernel: missing',
        'opt_state/1/0/mu/params/decoder/layers_1/self_attention/query/kernel: missing',
        'params/params/decoder/decoder_norm/scale: dtype: expected bfloat16, got float32',
    ]),
    'tied_wider_mlp': ({'logits_via_embedding': True, 'mlp_dim': 96}, [
        'params/params/decoder/logits_dense/kernel: extra',
        'opt_state/1/0/nu/params/decoder/logits_dense/kernel: extra',
        'params/params/decoder/layers/mlp/wo/kernel: shape: expected [96, 2, 64], got [128, 2, 64]',
    ]),
}


@pytest.mark.parametrize('side_name', SIDES)
@pytest.mark.parametrize('case', sorted(MISMATCHED))
def test_restore_into_mismatched_tree_names_every_path(resume_runs, case, side_name):
  changes, expected_lines = MISMATCHED[case]
  model_cfg, train_cfg = get_configs('tiny', RESUME_SCENARIO)
  side = dict(zip(SIDES, make_sides(replace(model_cfg, **changes), train_cfg)))[side_name]
  manager = resume_runs(None).managers['linen']
  with pytest.raises(TreeMismatchError) as raised:
    ck.restore(manager, SAVE_AT, side)
  message = str(raised.value)
  assert message.startswith(f'checkpoint step {SAVE_AT} -> {side_name} train state: ')
  for line in expected_lines:
    assert f'  {line}' in message, message


def test_restore_of_missing_step_names_the_steps_there(resume_runs):
  manager = resume_runs(None).managers['nnx']
  with pytest.raises(ck.CheckpointError, match=r'step 7 does not exist in .*; steps there: \[5\]'):
    ck.restore(manager, 7, resume_runs(None).sides['nnx'])
