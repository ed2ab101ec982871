"""The localizer on the mesh: a divergence seen only there is localised there.

A constraint that places an intermediate otherwise changes nothing on one
device, but on a mesh XLA splits the work by it: here the NNX side leaves an
MLP's hidden activations replicated where the Linen side shards them over
'tensor', so their root mean square is summed in two partial sums on Linen
and in one on NNX, a few ULP apart. Everything compares bitwise on
one device; the mesh part fails and names the module and the placement.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import parity
from parity.battery import checks

MESH = 'data=2,fsdp=2,tensor=2'
RULES = (('batch', 'data'), ('hidden', 'tensor'), ('embed', None))
EMBED, HIDDEN, BATCH = 24, 200, 8


def _normalised(h):
  """`h` over its root mean square: a reduction over the hidden axis, split by its placement."""
  return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(HIDDEN, name='wi')(x))
    h = nn.with_logical_constraint(h, ('batch', 'hidden'))
    return nn.Dense(EMBED, name='wo')(_normalised(h))


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return LinenMlp(name='mlp')(x)


class NnxMlp(nnx.Module):
  def __init__(self, hidden_axes, *, rngs):
    self.wi = nnx.Linear(EMBED, HIDDEN, rngs=rngs)
    self.wo = nnx.Linear(HIDDEN, EMBED, rngs=rngs)
    self.hidden_axes = hidden_axes

  def __call__(self, x):
    h = nn.with_logical_constraint(nnx.relu(self.wi(x)), self.hidden_axes)
    return self.wo(_normalised(h))


class NnxNet(nnx.Module):
  def __init__(self, hidden_axes, *, rngs):
    self.mlp = NnxMlp(hidden_axes, rngs=rngs)

  def __call__(self, x):
    return self.mlp(x)


def _batch(step, split):
  x = jax.random.normal(jax.random.key(step + (100 if split == 'eval' else 0)), (BATCH, EMBED))
  return {'x': x, 'y': jnp.roll(x, 1, axis=-1)}


def linen_loss(params, state, batch, key):
  return jnp.mean((state.apply_fn({'params': params}, batch['x']) - batch['y']) ** 2)


@jax.jit
def linen_train(state, batch, dropout_base):
  loss, grads = jax.value_and_grad(linen_loss)(state.params, state, batch, None)
  return state.apply_gradients(grads=grads), {'loss': loss}


@jax.jit
def linen_eval(state, batch):
  return {'loss': linen_loss(state.params, state, batch, None)}


def linen_create(seed):
  model = LinenNet()
  params = model.init(jax.random.key(seed), jnp.ones((1, EMBED)))['params']
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))


def nnx_loss(model, batch, key=None):
  return jnp.mean((model(batch['x']) - batch['y']) ** 2)


@nnx.jit
def nnx_train(model, optimizer, batch, dropout_base):
  loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
  optimizer.update(model, grads)
  return {'loss': loss}


@nnx.jit
def nnx_eval(model, batch):
  return {'loss': nnx_loss(model, batch)}


def nnx_create(hidden_axes, seed):
  model = NnxNet(hidden_axes, rngs=nnx.Rngs(seed))
  return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _pair(name: str, hidden_axes: tuple) -> parity.Pair:
  def make_sides(mesh):
    return (parity.StockLinen(linen_create, linen_train, linen_eval, linen_loss, mesh=mesh, rules=RULES),
            parity.StockNnx(functools.partial(nnx_create, hidden_axes), nnx_train, nnx_eval, nnx_loss,
                            mesh=mesh, rules=RULES))

  return parity.Pair(name, make_sides, _batch, meshes=(MESH,), steps=3)


pytestmark = pytest.mark.xdist_group('parity-localize-mesh')


def test_an_intermediate_placed_otherwise_is_localised_on_the_mesh():
  """Bitwise on one device, different on the mesh: the mesh part names the MLP and its placement."""
  pair = _pair('placed_otherwise', ('batch', None))
  assert checks.check_grads(pair) == []  # one device: nothing differs
  with pytest.raises(AssertionError) as failure:
    checks.check_mesh(pair, MESH)
  message = str(failure.value)
  assert f'localizer on {MESH}:' in message, message
  assert 'module mlp places its intermediates otherwise' in message, message
  line = next(line for line in message.splitlines() if 'module mlp places' in line)
  assert '"tensor"' in line.split('NNX')[0] and '"tensor"' not in line.split('NNX')[1], line


def test_the_same_placement_passes_the_mesh_part():
  """The control: with the same constraint on both sides, the mesh part passes."""
  assert checks.check_mesh(_pair('placed_alike', ('batch', 'hidden')), MESH) == []
