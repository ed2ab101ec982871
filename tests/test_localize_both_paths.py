"""The localizer names each module by both sides' paths: Linen's, and the NNX attribute path
the user edits where it is another (`LayerNorm_1 (NNX: ln2)`), as the pair's correspondence
(inferred here: no renames given) pairs them.

A tiny stock pair: Linen's automatic names (`LayerNorm_0`, `Block_0/Dense_0`, `LayerNorm_1`,
`Dense_0`) against NNX attributes (`ln1`, `block/dense`, `ln2`, `head`); the NNX side is broken
in one place at a time.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import parity
from parity.compare import localize
from parity.core import rng
from parity.pairs import adapter


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(jnp.tanh(nn.Dense(8)(x)))


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = Block()(nn.LayerNorm()(x))
    return nn.Dense(4)(nn.LayerNorm()(x))


@jax.custom_vjp
def _grad_scaled(w):
  return w


_grad_scaled.defvjp(lambda w: (w, None), lambda _, g: (g * 1.0001,))


class GradScaledLinear(nnx.Linear):
  """nnx.Linear whose kernel's gradient is scaled: its backward pass alone differs."""

  def __call__(self, x):
    return x @ _grad_scaled(self.kernel[...]) + self.bias[...]


class NnxBlock(nnx.Module):
  def __init__(self, shift: float, rngs: nnx.Rngs):
    self.dense = nnx.Linear(6, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.shift = shift  # the bug 'inside': the block's own code between its submodules

  def __call__(self, x):
    return self.norm(jnp.tanh(self.dense(x)) + self.shift)


class NnxNet(nnx.Module):
  def __init__(self, bug: str | None, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(6, rngs=rngs)
    self.block = NnxBlock(1e-3 if bug == 'inside' else 0.0, rngs)
    self.ln2 = nnx.LayerNorm(8, epsilon=1e-3 if bug == 'epsilon' else 1e-6, rngs=rngs)
    self.head = (GradScaledLinear if bug == 'backward' else nnx.Linear)(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(self.ln2(self.block(self.ln1(x))))


def _batch(step, split='train'):
  r = np.random.default_rng(step)
  return {'x': r.normal(size=(5, 6)).astype(np.float32), 'y': r.normal(size=(5, 4)).astype(np.float32)}


def _pair(bug):
  def make_sides(mesh):
    def linen_create(seed):
      model = LinenNet()
      params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 6)))['params']
      return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def linen_loss(params, state, batch, key):
      return jnp.mean(jnp.square(state.apply_fn({'params': params}, batch['x']) - batch['y']))

    def nnx_create(seed):
      model = NnxNet(bug, nnx.Rngs(params=seed))
      return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_loss(model, batch, key):
      return jnp.mean(jnp.square(model(batch['x']) - batch['y']))

    return (parity.StockLinen(linen_create, None, None, linen_loss, mesh=mesh),
            parity.StockNnx(nnx_create, None, None, nnx_loss, mesh=mesh))

  return parity.Pair(f'both_paths_{bug}', make_sides, _batch)


def _localize(bug) -> localize.Localization:
  pair = _pair(bug)
  linen, nnx_side = adapter.make_pair_sides(pair, None)  # the correspondence inferred
  state = linen.to_checkpoint(linen.init(0))
  batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
  return localize.localize_step(linen, nnx_side, state, batch, rng.step_key(rng.base_key(0), 0, 0))


def test_a_forward_difference_names_the_module_on_both_sides():
  result = _localize('epsilon')
  assert result.forward == 'LayerNorm_1', result.lines()  # the module's Linen path, as before
  assert result.lines()[0].startswith('forward pass: first differs at module LayerNorm_1 (NNX: ln2) ('), \
      result.lines()


def test_a_difference_inside_a_module_names_it_and_its_call_on_both_sides():
  line = _localize('inside').lines()[0]
  assert line.startswith(
      'forward pass: inside module Block_0 (NNX: block), outside its submodules: the input of'
      ' Block_0/LayerNorm_0 (NNX: block/norm) differs while every earlier call agrees'), line


def test_a_backward_difference_names_the_module_on_both_sides():
  result = _localize('backward')
  assert result.forward is None and result.backward[0][0] == 'Dense_0', result.lines()
  assert result.lines()[1].startswith(
      'backward pass: inside module Dense_0 (NNX: head): output cotangent bitwise equal,'
      ' gradients differ: params/Dense_0/kernel'), result.lines()


def test_a_call_the_correspondence_names_otherwise_is_named_as_nnx_made_it():
  """One NNX module called twice where Linen has two (a call key, `dropout#1` for `Dropout_1`),
  inside a renamed module: its NNX name is the call as made, its path renamed back."""
  renames = parity.Renames((('MlpBlock_0', 'mlp'),))
  made_as = {'MlpBlock_0/Dropout_1': 'MlpBlock_0/dropout#1', 'MlpBlock_0/Dropout_0': 'MlpBlock_0/dropout'}
  keys = ['MlpBlock_0/Dense_0', 'MlpBlock_0/Dropout_0', 'MlpBlock_0/Dropout_1', 'MlpBlock_0', 'head']
  names = localize.nnx_names(keys, made_as, renames.to_nnx)
  assert names == {'MlpBlock_0/Dense_0': 'mlp/Dense_0', 'MlpBlock_0/Dropout_0': 'mlp/dropout',
                   'MlpBlock_0/Dropout_1': 'mlp/dropout#1', 'MlpBlock_0': 'mlp'}
  shown = localize.Localization(None, None, False, None, [], [], [], {}, nnx_names=names)
  assert shown._module('MlpBlock_0/Dropout_1') == 'MlpBlock_0/Dropout_1 (NNX: mlp/dropout)'
  assert shown._call('MlpBlock_0/Dropout_1') == 'MlpBlock_0/Dropout_1 (NNX: mlp/dropout#1)'
  assert shown._module('head') == 'head' and shown._call('(model)') == '(model)'


def test_equal_sides_stay_clean():
  result = _localize(None)
  assert result.clean and not result.unmatched, result.lines()
