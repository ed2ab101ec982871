"""A tiny pair for the checkpoint converter's tests (tests/test_pair_checkpoints.py).

Everything a converter must carry, in a few hundred parameters: Linen's
automatic names (`Dense_0`, `BatchNorm_0`) against NNX attributes (`inp`,
`norm`), `batch_stats` against `nnx.BatchStat`, an optax chain with empty
states (`clip_by_global_norm`, `adamw`: `EmptyState()` placeholders on
Linen, int-keyed dicts on NNX) and Adam's `mu` and `nu`, the step (int32
against uint32), and an RNG stream the NNX model keeps (`nnx.Dropout(0.0,
rngs=...)`: state only NNX has; at rate 0 it never draws, so the numbers
stay Linen's). Kept out of test files: a Pair at module level of a test file
gets the whole battery generated.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import parity

FEATURES, HIDDEN, OUT, ROWS = 4, 8, 3, 8


def make_optimizer() -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(HIDDEN)(x))
    x = nn.Dropout(0.0)(nn.relu(x), deterministic=not train)
    return nn.Dense(OUT)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any = None


def linen_create(seed: int) -> TrainState:
  model = LinenNet()
  variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, FEATURES)), train=False)
  return TrainState.create(apply_fn=model.apply, params=variables['params'],
                           batch_stats=variables['batch_stats'], tx=make_optimizer())


def linen_loss(params, state, batch, key):
  y, updates = state.apply_fn({'params': params, 'batch_stats': state.batch_stats}, batch['x'], train=True,
                              mutable=['batch_stats'])
  return jnp.mean((y - batch['y']) ** 2), updates['batch_stats']


@jax.jit
def linen_train(state, batch, dropout_base):
  (loss, stats), grads = jax.value_and_grad(linen_loss, has_aux=True)(state.params, state, batch, None)
  return state.apply_gradients(grads=grads).replace(batch_stats=stats), {'loss': loss}


@jax.jit
def linen_eval(state, batch):
  y = state.apply_fn({'params': state.params, 'batch_stats': state.batch_stats}, batch['x'], train=False)
  return {'loss': jnp.mean((y - batch['y']) ** 2)}


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.inp = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.norm = nnx.BatchNorm(HIDDEN, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.0, rngs=rngs)  # keeps a stream: state only NNX has
    self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

  def __call__(self, x, train: bool):
    x = self.norm(self.inp(x), use_running_average=not train)
    return self.out(self.drop(nnx.relu(x), deterministic=not train))


def nnx_create(seed: int):
  model = NnxNet(nnx.Rngs(params=seed, dropout=seed + 1))
  return model, nnx.Optimizer(model, make_optimizer(), wrt=nnx.Param)


def nnx_loss(model, batch, key):
  return jnp.mean((model(batch['x'], train=True) - batch['y']) ** 2)


@nnx.jit
def nnx_train(model, optimizer, batch, dropout_base):
  loss, grads = nnx.value_and_grad(nnx_loss)(model, batch, None)
  optimizer.update(model, grads)
  return {'loss': loss}


@nnx.jit
def nnx_eval(model, batch):
  return {'loss': jnp.mean((model(batch['x'], train=False) - batch['y']) ** 2)}


def make_sides(mesh, nnx_train_step=nnx_train):
  linen = parity.StockLinen(linen_create, linen_train, linen_eval, linen_loss, has_aux=True, mesh=mesh)
  nnx_side = parity.StockNnx(nnx_create, nnx_train_step, nnx_eval, nnx_loss, mesh=mesh)
  return linen, nnx_side


def batch(step: int, split: str = 'train') -> dict[str, np.ndarray]:
  gen = np.random.default_rng(step * 2 + (split == 'eval'))
  return {'x': gen.standard_normal((ROWS, FEATURES), np.float32),
          'y': gen.standard_normal((ROWS, OUT), np.float32)}


tiny = parity.Pair('checkpoint_tiny', make_sides, batch)


@nnx.jit
def _nnx_train_scaled(model, optimizer, batch, dropout_base):
  """A planted bug: the NNX step scales its loss, so a resumed step differs from Linen's."""
  loss, grads = nnx.value_and_grad(lambda m, b, k: 1.5 * nnx_loss(m, b, k))(model, batch, None)
  optimizer.update(model, grads)
  return {'loss': loss}


# The same model with an NNX train step that differs: verification must fail, naming leaves.
tiny_broken_step = parity.Pair('checkpoint_tiny_broken_step',
                               functools.partial(make_sides, nnx_train_step=_nnx_train_scaled), batch)
