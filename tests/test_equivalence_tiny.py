"""The `tiny` preset: logits, loss, gradients, 10 training steps and eval, bit for bit.

One side is initialised and its state carried to the other by the bridge, in
both directions. Every comparison is bitwise (parity.bitwise), no tolerance.
"""
import pytest

from models import data
from parity.bitwise import assert_bitwise_equal
from parity.sides import as_jax_batch
from bridge import train_state as bridge_state
from tests.runs import STEPS, tiny_run


@pytest.fixture(scope='module')
def start(tiny_sides):
  """(linen state, nnx state) holding the same Linen-initialised values."""
  linen, nnx_side = tiny_sides
  linen_state = linen.init(0)
  return linen_state, nnx_side.from_checkpoint(linen.to_checkpoint(linen_state))


def test_logits_bitwise(tiny_sides, start, tiny_batch, dropout_base):
  linen, nnx_side = tiny_sides
  assert_bitwise_equal(
      linen.forward(start[0], tiny_batch, dropout_base),
      nnx_side.forward(start[1], tiny_batch, dropout_base),
      'logits',
  )


def test_loss_and_gradients_bitwise(tiny_sides, start, tiny_batch, dropout_base):
  linen, nnx_side = tiny_sides
  linen_loss, linen_grads = linen.loss_and_grad(start[0], tiny_batch, dropout_base)
  nnx_loss, nnx_grads = nnx_side.loss_and_grad(start[1], tiny_batch, dropout_base)
  assert_bitwise_equal(linen_loss, nnx_loss, 'loss sums and token counts')
  nnx_grads_linen_tree = bridge_state.nnx_params_to_linen(
      nnx_grads, start[0].params, nnx_side.layout
  )
  assert_bitwise_equal(linen_grads, nnx_grads_linen_tree, 'gradients')


@pytest.mark.parametrize('init_side', ['linen', 'nnx'])
def test_ten_steps_bitwise(init_side):
  result = tiny_run('01_baseline', init_side)
  assert result.linen.loss_hex == result.nnx.loss_hex
  assert result.first_divergent_step is None
  assert result.state_diffs == [], '\n'.join(result.state_diffs)
  # Training moved the parameters: a step that does nothing would also "match".
  assert len(set(result.linen.loss_hex)) == STEPS


def test_final_state_bitwise_and_changed(tiny_sides, start, dropout_base, tiny_cfgs):
  """Final params and optimizer state after 3 steps, compared leaf by leaf."""
  linen, nnx_side = tiny_sides
  linen_state, nnx_state = start
  for step in range(3):
    batch = as_jax_batch(data.make_batch(*tiny_cfgs, step=step))
    linen_state, _ = linen.train_step(linen_state, batch, dropout_base)
    nnx_state, _ = nnx_side.train_step(nnx_state, batch, dropout_base)
  final = linen.to_checkpoint(linen_state)
  assert_bitwise_equal(final, nnx_side.to_checkpoint(nnx_state), 'final train state')
  assert int(final['step']) == 3
  with pytest.raises(AssertionError):
    assert_bitwise_equal(final, linen.to_checkpoint(start[0]), 'trained vs initial')


def test_eval_step_bitwise(tiny_sides, start, tiny_cfgs):
  linen, nnx_side = tiny_sides
  batch = as_jax_batch(data.make_batch(*tiny_cfgs, step=0, split='eval'))
  linen_metrics = linen.eval_step(start[0], batch)
  assert_bitwise_equal(linen_metrics, nnx_side.eval_step(start[1], batch), 'eval metrics')
  assert float(linen_metrics['tokens']) == float((batch['segment_ids'] != 0).sum())
