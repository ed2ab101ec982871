"""A half-migrated model behind flax's own `nnx.bridge.ToLinen`, dropout on in both places: the
Linen side runs an NNX MLP (its `nnx.Dropout` keeping a stream) behind flax's wrapper, beside a
Linen `nn.Dropout` of its own; the NNX side is the fully migrated model with the same MLP class.

Flax's wrapper builds the NNX module at init from init's keys (so the model-level API gives `init` a
'dropout' key) and afresh at every apply from `make_rng` keys; the kit follows those keys by
behaviour (parity/pairs/dropout.py, `_Lineage`), so the full battery generated below passes bit for
bit. The planted test gives the NNX side's MLP dropout another rate: the grads part names the rates.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parity
from parity.battery import checks

RATE = 0.1


class NnxMlp(nnx.Module):
  """The layer already migrated: two projections, a dropout between them keeping its own stream."""

  def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(features, hidden, rngs=rngs)
    self.dropout = nnx.Dropout(RATE, rngs=rngs)
    self.down = nnx.Linear(hidden, features, rngs=rngs)

  def __call__(self, x, deterministic: bool = True):
    return self.down(self.dropout(nnx.relu(self.up(x)), deterministic=deterministic))


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(16, name='inp')(x)
    x = nn.Dropout(RATE, name='drop')(x, deterministic=not train)
    x = x + nnx.bridge.ToLinen(NnxMlp, args=(16, 32), name='mlp')(x, deterministic=not train)
    return nn.Dense(2, name='out')(x)


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, mlp=NnxMlp):
    self.inp = nnx.Linear(3, 16, rngs=rngs)
    self.drop = nnx.Dropout(RATE, rngs=rngs)
    self.mlp = mlp(16, 32, rngs=rngs)
    self.out = nnx.Linear(16, 2, rngs=rngs)

  def __call__(self, x, train: bool):
    x = self.drop(self.inp(x), deterministic=not train)
    x = x + self.mlp(x, deterministic=not train)
    return self.out(x)


def batch(step, split='train'):
  rng = np.random.default_rng(2 * step + (split == 'eval'))
  return {'x': rng.standard_normal((8, 3)).astype(np.float32), 'y': rng.standard_normal((8, 2)).astype(np.float32)}


def _loss(y, b):
  return jnp.mean((y - b['y']) ** 2)


def _pair(name, nnx_model=NnxNet, **options):
  return parity.model_pair(name, linen=LinenNet(), nnx=nnx_model, inputs=lambda b: b['x'], loss=_loss,
                           optimizer=optax.adam(1e-2), batch=batch, **options)


tolinen_flax = _pair('tolinen_flax')


class _OtherRate(NnxMlp):
  """Planted: the NNX side's MLP dropout at 0.2, Linen's at 0.1."""

  def __init__(self, features, hidden, *, rngs):
    super().__init__(features, hidden, rngs=rngs)
    self.dropout = nnx.Dropout(2 * RATE, rngs=rngs)


@pytest.mark.xdist_group('parity-tolinen_flax')
def test_a_dropout_rate_that_differs_behind_the_wrapper_is_named_as_rates():
  """The MLP's dropout rate 0.2 on the NNX side: the grads part fails at mlp/dropout, naming the
  two rates, not the keys."""
  pair = _pair('tolinen_flax_other_rate', nnx_model=lambda rngs: NnxNet(rngs, mlp=_OtherRate), parts=('grads',))
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  message = str(failure.value)
  assert 'forward pass: first differs at module mlp/dropout (' in message, message
  assert "mlp/dropout: the dropout rates differ: Linen's 0.1, NNX's 0.2" in message, message
  assert 'still differs' not in message
