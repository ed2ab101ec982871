"""The `tiny` preset in every scenario: logits, loss, gradients and eval, bit for bit.

One side is initialised and its state carried to the other by the bridge.
Every comparison is bitwise (parity.core.bitwise), no tolerance. The 10-step
training runs (both init directions, final parameters and optimizer state)
and the spec tables of every scenario are in test_scenarios.py; here are the
pieces a training run is made of, so a divergence is found where it starts.
The loss and gradients of every scenario are compared by the plugin's
`decoder_<scenario>::test_grads` (test_decoder_pairs.py), with the
localizer's finding on failure.

Dropout scenarios run the forward pass and the gradients with dropout on,
from the same base key: the masks must agree too. In `06_grad_accum` the
single-batch loss and gradients are compared (the accumulation scan is in the
train step). Gradients are the parameters' (what the optimizer gets); in
`05_fp8` the scaling state the train step overwrites is followed step by
step in test_fp8.py.
"""
import pytest

from models import data, rng
from models.config import SCENARIOS, get_configs
from parity.core.bitwise import assert_bitwise_equal
from bridge.sides import as_jax_batch
from tests import tiers
from tests.runs import start

SCENARIO_NAMES = sorted(SCENARIOS)


def _batch(scenario: str, split: str = 'train'):
  return as_jax_batch(data.make_batch(*get_configs('tiny', scenario), step=0, split=split))


@pytest.mark.parametrize('scenario', SCENARIO_NAMES)
def test_logits_bitwise(scenario):
  (linen, nnx_side), (linen_state, nnx_state) = start(scenario)
  batch, key = _batch(scenario), rng.base_key(0)
  assert_bitwise_equal(
      linen.forward(linen_state, batch, key), nnx_side.forward(nnx_state, batch, key), 'logits'
  )


@pytest.mark.parametrize('scenario', SCENARIO_NAMES)
def test_eval_step_bitwise(scenario):
  (linen, nnx_side), (linen_state, nnx_state) = start(scenario)
  batch = _batch(scenario, 'eval')
  linen_metrics = linen.eval_step(linen_state, batch)
  assert_bitwise_equal(linen_metrics, nnx_side.eval_step(nnx_state, batch), 'eval metrics')
  assert float(linen_metrics['tokens']) == float((batch['segment_ids'] != 0).sum())


@pytest.mark.xdist_group(tiers.TINY_PRESET_GROUP)  # the baseline's train steps, as the CLI's compare
def test_final_state_bitwise_and_changed():
  """Final params and optimizer state after 3 steps, compared leaf by leaf."""
  (linen, nnx_side), (linen_state, nnx_state) = start('01_baseline')
  cfgs = get_configs('tiny', '01_baseline')
  initial = linen.to_checkpoint(linen_state)
  key = rng.base_key(0)
  for step in range(3):
    batch = as_jax_batch(data.make_batch(*cfgs, step=step))
    linen_state, _ = linen.train_step(linen_state, batch, key)
    nnx_state, _ = nnx_side.train_step(nnx_state, batch, key)
  final = linen.to_checkpoint(linen_state)
  assert_bitwise_equal(final, nnx_side.to_checkpoint(nnx_state), 'final train state')
  assert int(final['step']) == 3
  with pytest.raises(AssertionError):
    assert_bitwise_equal(final, initial, 'trained vs initial')
