"""A parameter the model holds itself (`self.param`, an `nnx.Param` attribute), named otherwise on each
side: the structure part names the rename that pairs it, and the rename it prints makes the pair pass."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parity
from parity.battery import checks

pytestmark = pytest.mark.xdist_group('renamed-parameters')


class LinenScaled(nn.Module):
  @nn.compact
  def __call__(self, x):
    offset = self.param('offset', nn.initializers.normal(1.0), (4,))
    return nn.Dense(4)(x) + offset


class NnxScaled(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.dense = nnx.Linear(8, 4, rngs=rngs)
    self.shift = nnx.Param(jax.random.normal(rngs.params(), (4,)))

  def __call__(self, x):
    return self.dense(x) + self.shift


def batch(step, split):
  rng = np.random.default_rng([step, {'train': 0, 'eval': 1}[split]])
  return {'x': rng.normal(size=(8, 8)).astype(np.float32), 'y': rng.normal(size=(8, 4)).astype(np.float32)}


def _pair(name, **options):
  return parity.model_pair(name, linen=LinenScaled(), nnx=NnxScaled, inputs=lambda b: b['x'],
                           loss=lambda out, b: jnp.mean((out - b['y']) ** 2), optimizer=optax.sgd(0.1),
                           batch=batch, mode=None, dropout=None, parts=('structure', 'grads'), **options)


def test_a_parameter_named_otherwise_gets_the_rename_that_pairs_it():
  with pytest.raises(AssertionError) as failure:
    checks.check_structure(_pair('renamed_unpaired'))
  message = str(failure.value)
  assert 'params/offset: missing' in message and 'params/shift: extra' in message, message
  fix = "renames=parity.Renames((('offset', 'shift'),))"
  assert ('parameters named otherwise on each side, of one shape and dtype under one module: params/offset'
          f' (NNX: shift). If they are the same parameters, rename them on the NNX side: {fix}') in message, message
  # The rename as printed pairs them: the structure matches and the gradients are bit for bit.
  paired = _pair('renamed_paired', nnx_options={'renames': parity.Renames((('offset', 'shift'),))})
  checks.check_structure(paired)
  checks.check_grads(paired)
