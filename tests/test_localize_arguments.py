"""The localizer pairs a layer's arguments across the sides by what they are, not where they stand.

A layer given a token's positions and its segment ids: the Linen layer names them in its
signature in one order (`positions, segment_ids`); the NNX layer takes them through `*args`, in
the other order, as a layer called through a generic wrapper's signature gets them. Both models
compute the same numbers. Matched by position, `segment_ids` would meet the positions and the
localizer would blame a difference that is not there; matched by value, the calls are the same
call. A real difference in one of them is still named with its argument.
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

B, L, F = 4, 6, 8


def batch(step, split='train'):
  rng = np.random.default_rng(step + (100 if split == 'eval' else 0))
  return {'x': rng.standard_normal((B, L, F)).astype(np.float32),
          'positions': np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
          'segment_ids': np.repeat(np.asarray([[1, 1, 1, 2, 2, 3]], np.int32), B, axis=0),
          'y': rng.standard_normal((B, L, 1)).astype(np.float32)}


def _mixed(h, positions, segment_ids):
  """What the layer does with its two integer arguments (each changes the numbers)."""
  return h * (1.0 + positions[..., None].astype(h.dtype) / L) + segment_ids[..., None].astype(h.dtype)


class LinenLayer(nn.Module):
  @nn.compact
  def __call__(self, x, positions, segment_ids):
    return _mixed(nn.Dense(F)(x), positions, segment_ids)


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x, positions, segment_ids):
    return nn.Dense(1)(LinenLayer()(x, positions, segment_ids))


class NnxLayer(nnx.Module):
  def __init__(self, rngs):
    self.Dense_0 = nnx.Linear(F, F, rngs=rngs)

  def __call__(self, x, *args):
    segment_ids, positions = args
    return _mixed(self.Dense_0(x), positions, segment_ids)


class NnxModel(nnx.Module):
  def __init__(self, rngs, segment_bug=0):
    self.LinenLayer_0 = NnxLayer(rngs)
    self.Dense_0 = nnx.Linear(F, 1, rngs=rngs)
    self.segment_bug = segment_bug

  def __call__(self, x, positions, segment_ids):
    return self.Dense_0(self.LinenLayer_0(x, segment_ids + self.segment_bug, positions))


def _pair(name, segment_bug=0):
  return parity.model_pair(
      name, linen=LinenModel(), nnx=lambda rngs: NnxModel(rngs, segment_bug),
      inputs=lambda b: (b['x'], b['positions'], b['segment_ids']),
      loss=lambda y, b: jnp.mean((y - b['y']) ** 2), optimizer=optax.sgd(0.1), batch=batch,
      mode=None, dropout=None, parts=('localize',))


@pytest.mark.xdist_group('parity-localize-arguments')
def test_the_same_arrays_in_another_order_are_the_same_call():
  lines = checks.check_localize(_pair('arguments_reordered'))
  assert any('bitwise' in line for line in lines), lines


@pytest.mark.xdist_group('parity-localize-arguments')
def test_a_real_argument_difference_is_named_with_its_argument():
  """The NNX model adds 1 to the segment ids it passes the layer: the difference starts in the
  model's own code, named by the layer's Linen argument it feeds (`segment_ids`)."""
  with pytest.raises(AssertionError) as failure:
    checks.check_localize(_pair('arguments_reordered_bug', segment_bug=1))
  message = str(failure.value)
  assert 'forward divergence in undeclared module' in message, message
  assert 'the input of LinenLayer_0 differs while every earlier call agrees (its argument segment_ids:' in message, message
