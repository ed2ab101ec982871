"""The localizer inside scanned stacks: each layer's module calls recorded and named by index.

The localizer's probes open the bodies of `jax.lax.scan` and `jax.checkpoint`
(parity/compare/localize/, `layers_opened`): Linen `nn.scan(nn.remat(...))`
and NNX `jax.lax.scan` over `nnx.split` state (the production family,
tests/test_family_production.py), and `nnx.scan` over `nnx.vmap`-made layers.
A bug planted in layer 1 only fails the grads part, and the localizer names
layer 1: `layers/1/attention_norm`, reported as the stack's module
`layers/attention_norm` with `layer: 1`.

A bug in layer 1 needs the layer's index inside the scan body, where the
layers share one program: it is planted as state, an `nnx.Variable` stacked
per layer (one value in layer 1, the stock one elsewhere) in place of a
static attribute, kept out of the checkpoint layout as `nnx_only`.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

from parity.battery import checks
from parity.compare import localize
from parity.pairs.adapter import Pair
from tests import test_family_production as family
from models.linen import prod as linen_prod
from models.nnx import prod as nnx_prod

pytestmark = pytest.mark.xdist_group('parity-production')  # the Linen side's programs are the pair's


class Planted(nnx.Variable):
  """A planted bug's per-layer value: state only the broken NNX side keeps."""


def _per_layer(value, planted, layer: int = 1):
  """`value` in every layer but `layer`, which gets `planted`."""
  return Planted(jnp.full((family.CFG.num_layers,), value).at[layer].set(planted))


def _broken(name: str, create) -> Pair:
  def make_sides(mesh):
    linen, nnx_side = family.make_sides(mesh)
    return linen, dataclasses.replace(nnx_side, create=create, nnx_only=(nnx.RngState, Planted))

  return Pair(name, make_sides, family.production.batch, parts=('grads',))


def _failure(pair: Pair) -> str:
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  return str(failure.value)


@pytest.mark.exhaustive
def test_an_epsilon_changed_in_layer_1_of_the_nnx_scan_is_named_at_layer_1():
  """NNX `jax.lax.scan` over split state against Linen `nn.scan(nn.remat(Block))`: layer 1's
  attention norm (epsilon 1e-3, the stock 1e-6 elsewhere) is the first call that differs."""
  def create(seed):
    model, optimizer = nnx_prod.create_train_state(family.CFG, seed)
    # A static attribute until now: nnx.data makes it state, sliced by layer as the parameters.
    model.layers.attention_norm.epsilon = nnx.data(_per_layer(family.CFG.norm_epsilon, 1e-3))
    return model, optimizer

  pair = _broken('epsilon_in_layer_1', create)
  message = _failure(pair)
  assert 'forward pass: first differs at module layers/1/attention_norm (' in message, message
  assert 'RNG stream' not in message, message  # the norm draws nothing: no word of the layer's streams
  first = checks._runs(pair).localization().first(0)
  assert (first['path'], first['layer'], first['pass']) == ('layers/attention_norm', 1, 'forward'), first
  assert first['max_ulp'] >= 1


@pytest.mark.exhaustive
def test_a_scale_read_otherwise_in_layer_1_of_the_linen_scan_is_named_at_layer_1():
  """The bug on the Linen side, in `nn.scan(nn.remat(Block))`: its loss reads layer 1's attention
  norm scale 2^-10 larger (the other layers as they are)."""
  def loss(params, state, batch, key):
    layers = dict(params['layers'])
    layers['attention_norm'] = {'scale': layers['attention_norm']['scale'].at[1].multiply(1 + 2 ** -10)}
    return linen_prod.loss_fn({**params, 'layers': layers}, state, batch, key)

  def make_sides(mesh):
    linen, nnx_side = family.make_sides(mesh)
    return dataclasses.replace(linen, loss=loss), nnx_side

  pair = Pair('scale_in_layer_1', make_sides, family.production.batch, parts=('grads',))
  message = _failure(pair)
  assert 'forward pass: first differs at module layers/1/attention_norm (' in message, message
  first = checks._runs(pair).localization().first(0)
  assert (first['path'], first['layer'], first['pass']) == ('layers/attention_norm', 1, 'forward'), first


@jax.custom_vjp
def _cotangent_scaled(x, scale):
  return x


_cotangent_scaled.defvjp(lambda x, scale: (x, scale), lambda scale, g: (g * scale, jnp.zeros_like(scale)))


@pytest.mark.exhaustive
class _CotangentScaledMlp(nnx_prod.Mlp):
  """The MLP (the class the Linen side runs behind its wrapper, too) with its hidden units'
  cotangent scaled by `planted`: put on the NNX model's layers alone."""

  def __call__(self, x, deterministic: bool = True):
    hidden = nnx_prod.constrain(nnx.silu(self.wi_0(x)) * self.wi_1(x), 'mlp')
    return self.wo(self.dropout(_cotangent_scaled(hidden, self.planted[...]), deterministic=deterministic))


def test_a_backward_only_bug_in_layer_1_of_the_nnx_scan_is_named_at_layer_1():
  """Layer 1's MLP scales the cotangent of its hidden units (the forward untouched): its output
  cotangent is equal on both sides, the gradients of its two input projections are not, in
  layer 1's slice of the stacked kernels."""
  def create(seed):
    model, optimizer = nnx_prod.create_train_state(family.CFG, seed)
    model.layers.mlp.planted = _per_layer(1.0, 1.5)
    model.layers.mlp.__class__ = _CotangentScaledMlp
    return model, optimizer

  pair = _broken('backward_in_layer_1', create)
  message = _failure(pair)
  assert 'forward pass: every module output bitwise equal' in message, message
  assert ('backward pass: inside module layers/1/mlp: output cotangent bitwise equal, gradients differ:'
          ' params/layers/mlp/wi_0/kernel (layer 1: ') in message, message
  first = checks._runs(pair).localization().first(0)
  assert (first['path'], first['layer'], first['pass']) == ('layers/mlp', 1, 'backward'), first


# ---------------------------------------------------------------------------
# Small stacks, probed directly: each scan style names its layers alike.
# ---------------------------------------------------------------------------

LAYERS = 3


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(8, name='dense')(x)), None


class LinenStack(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(LinenBlock, prevent_cse=False) if self.remat else LinenBlock
    stack = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True}, length=LAYERS)
    x, _ = stack(name='blocks')(x, None)
    return nn.Dense(4, name='head')(x)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.dense(x))


class NnxStack(nnx.Module):
  """`nnx.scan` over `nnx.vmap`-made blocks (the reference decoder's style)."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return NnxBlock(rngs)

    self.blocks = stacked(rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(body(x, self.blocks))


def _linen_probe(remat: bool):
  model = LinenStack(remat)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 8)))['params']
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

  def loss(params, state, batch, key):
    return jnp.mean(jnp.square(state.apply_fn({'params': params}, batch['x'])))

  return localize.linen_probe(loss, False, state, {'x': jnp.ones((2, 8))}, jax.random.PRNGKey(1))


def _nnx_probe():
  from parity.pairs.stock_layout import Renames

  model = NnxStack(nnx.Rngs(params=0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def loss(model, batch, key):
    return jnp.mean(jnp.square(model(batch['x'])))

  return localize.nnx_probe(loss, graphdef, state, {'x': jnp.ones((2, 8))}, jax.random.PRNGKey(1), Renames())


@pytest.mark.parametrize('style', ['nn.scan', 'nn.scan(nn.remat)', 'nnx.scan'])
def test_opened_probes_name_each_layer_of_a_stack(style):
  with localize.layers_opened():
    probe = _nnx_probe() if style == 'nnx.scan' else _linen_probe(remat='remat' in style)
  assert probe.order == ['blocks/0/dense', 'blocks/0', 'blocks/1/dense', 'blocks/1', 'blocks/2/dense',
                         'blocks/2', 'head', localize.ROOT], probe.order
  assert probe.unrecorded == ()
  assert probe.outputs['blocks/1/dense'].shape == (2, 8) and probe.cotangents['blocks/1'].shape == (2, 8)
  assert probe.stacked == {'blocks': ('params/blocks/dense/bias', 'params/blocks/dense/kernel')}
  # Not opened (the probes as a side's `probe` gives them): the stack is not recorded.
  plain = _nnx_probe() if style == 'nnx.scan' else _linen_probe(remat='remat' in style)
  assert plain.order == ['head', localize.ROOT] and 'blocks/dense' in plain.unrecorded
