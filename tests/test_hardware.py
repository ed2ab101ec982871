"""The hardware tier: the mesh battery on the accelerator's devices with a large bf16 preset.

On an accelerator host (`pytest -m hardware`; `-m tpu` is the same tier by
its older name), TPU or GPU alike, both sides build the `tpu` preset (443M
parameters, bfloat16 weights and moments) on an `fsdp=<all local devices>`
mesh and train a few steps from one state (on a GPU with rematerialisation,
scenario `04_remat`), bitwise across sides; a
checkpoint saved by one side is restored by the other. On a GPU the suite
has set `--xla_gpu_deterministic_ops=true` before jax started (conftest.py,
parity/env/xla_env.py); without it XLA:GPU may reorder sums from run to run.

Elsewhere these tests are skipped with a reason, unless `--hardware-on-cpu`
is given: then the same tests run on the 8 CPU devices with the tiny preset
in bfloat16 (scenario `08_bf16_weights`) on the 3-axis mesh, so the tier's
code runs in every CI job (`make test-all` passes the option, and these
tests are in the exhaustive tier it adds, tests/tiers.py; that run is
shared with tests/test_sharding.py).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from parity.core import specs
from models.config import get_configs
from parity.core import bitwise
from parity.store import checkpoints
from bridge.sides import as_jax_batch, make_sides
from models import data, rng
from tests.runs import MESH_STEPS, mesh_run, train_on_mesh

pytestmark = [pytest.mark.hardware, pytest.mark.xdist_group('08_bf16_weights')]

CPU_SCENARIO, CPU_MESH = '08_bf16_weights', 'data=2,fsdp=2,tensor=2'


def _on_accelerator() -> bool:
  """On an accelerator (TPU or GPU): the large preset on all its devices."""
  return jax.default_backend() in ('tpu', 'gpu')


def _mesh_spec() -> str:
  return f'fsdp={jax.device_count()}' if _on_accelerator() else CPU_MESH


@functools.cache
def _configs():
  if jax.default_backend() == 'gpu':
    # One GPU holds both sides' states and one step's activations at a time;
    # rematerialisation keeps the activations of 24 layers at 32k tokens small.
    return get_configs('tpu', '04_remat')
  if _on_accelerator():
    return get_configs('tpu', '01_baseline')
  return get_configs('tiny', CPU_SCENARIO)


@functools.cache
def _tier_run():
  if not _on_accelerator():
    return mesh_run(CPU_SCENARIO, CPU_MESH)
  return train_on_mesh(*_configs(), specs.make_mesh(_mesh_spec()))


def test_tier_config_is_bfloat16():
  model_cfg, _ = _configs()
  assert model_cfg.weight_dtype == 'bfloat16'
  dtypes = {np.dtype(x.dtype).name for p, x in _tier_run().linen.final.items()
            if p.startswith('params/')}
  assert dtypes == {'bfloat16'}
  if _on_accelerator():
    assert model_cfg.param_count() > 400_000_000


def test_tier_shardings_identical_and_as_created():
  run = _tier_run()
  ndims = {p: np.ndim(x) for p, x in run.linen.final.items()}
  specs.check_same_shardings(run.linen.targets, run.nnx.targets, ndims)
  specs.check_same_shardings(run.linen.init_shardings, run.nnx.init_shardings, ndims)
  specs.check_same_shardings(run.linen.shardings, run.nnx.shardings, ndims)
  specs.check_same_shardings(run.linen.targets, run.linen.shardings, ndims)
  if jax.device_count() == 1 and _on_accelerator():
    return  # one device: every mesh axis has size 1, nothing can be split (the checks above still hold)
  # Split over an axis of more than one device: a spec naming only size-1 axes splits nothing.
  sharded = [p for p, s in run.linen.shardings.items() if len(s.device_set) > 1 and not s.is_fully_replicated]
  assert any(p.startswith('params/') for p in sharded), 'no parameter is sharded'


def test_tier_trains_bitwise_across_sides():
  run = _tier_run()
  assert len(run.linen.losses) == MESH_STEPS
  for step, (a, b) in enumerate(zip(run.linen.metrics, run.nnx.metrics)):
    bitwise.assert_bitwise_equal(a, b, f'train metrics at step {step}')
  bitwise.assert_bitwise_equal(run.linen.final, run.nnx.final, 'final state')


def test_tier_train_steps_carry_the_same_shardings():
  run = _tier_run()
  assert run.linen.annotations == run.nnx.annotations
  assert sum(run.linen.annotations.values()) > 2 * len(run.linen.final)


def test_tier_eval_step_bitwise_on_the_mesh():
  model_cfg, train_cfg = _configs()
  mesh = specs.make_mesh(_mesh_spec())
  linen, nnx_side = make_sides(model_cfg, train_cfg, mesh)
  run = _tier_run()
  batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, step=1000))
  linen_state = linen.from_checkpoint(run.linen.final)
  nnx_state = nnx_side.from_checkpoint(run.nnx.final)
  bitwise.assert_bitwise_equal(
      linen.eval_step(linen_state, batch), nnx_side.eval_step(nnx_state, batch), 'eval metrics'
  )


def test_tier_checkpoint_saved_by_one_side_restores_into_the_other(tmp_path):
  """Linen's trained state, saved with Orbax on the mesh, restores into NNX bitwise, and back."""
  model_cfg, train_cfg = _configs()
  linen, nnx_side = make_sides(model_cfg, train_cfg, specs.make_mesh(_mesh_spec()))
  run = _tier_run()
  base = rng.base_key(0)
  for step, (source, target, final) in enumerate(
      ((linen, nnx_side, run.linen.final), (nnx_side, linen, run.nnx.final))
  ):
    manager = checkpoints.open_manager(tmp_path / source.name)
    checkpoints.save(manager, step, source, source.from_checkpoint(final), base)
    manager.wait_until_finished()
    restored, restored_base = checkpoints.restore(manager, step, target)
    manager.close()
    flat = target.to_checkpoint(restored)
    bitwise.assert_bitwise_equal(flat, final, f'{source.name} checkpoint -> {target.name}')
    bitwise.assert_bitwise_equal(restored_base, base, 'dropout key')
    specs.check_same_shardings(
        {p: x.sharding for p, x in flat.items()}, target.checkpoint_shardings(),
        {p: np.ndim(x) for p, x in flat.items()},
    )
