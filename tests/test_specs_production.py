"""Production-sized rules and models that resolve their own activation names.

Rules with a hundred logical names must not crash the specs part (the
activation check once built one mesh axis per name: numpy allows 64), and a
pair whose activation constraints carry no logical name on either side must
never pass in silence: it fails, naming why, unless the pair declares that
the model resolves its names itself; then the physical specs are compared.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import parity
from models.families import ENCODER_RULES
from parity.battery import checks
from tests import test_family_encoder as encoder

FEATURES, HIDDEN = 6, 16


def _constrain(x, resolved):
  """`resolved`: False (logical names), else the mesh axes the model resolved them to itself."""
  if resolved is not False:
    if jax.sharding.get_abstract_mesh().empty:  # made outside a mesh (init): nothing to constrain
      return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*resolved))
  return nn.with_logical_constraint(x, ('batch', 'hidden'))


class LinenMlp(nn.Module):
  resolved: object

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(_constrain(nn.relu(nn.Dense(HIDDEN)(x)), self.resolved))


class NnxMlp(nnx.Module):
  def __init__(self, resolved, rngs):
    self.resolved = resolved
    self.hidden, self.out = nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(_constrain(nnx.relu(self.hidden(x)), self.resolved))


def _linen_create(resolved, seed):
  model = LinenMlp(resolved)
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, FEATURES)))['params']
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))


def _linen_loss(params, state, batch, key):
  return jnp.mean((state.apply_fn({'params': params}, batch['x']) - batch['y']) ** 2)


@jax.jit
def _linen_train(state, batch, dropout_base):
  loss, grads = jax.value_and_grad(_linen_loss)(state.params, state, batch, None)
  return state.apply_gradients(grads=grads), {'loss': loss}


@jax.jit
def _linen_eval(state, batch):
  return {'loss': _linen_loss(state.params, state, batch, None)}


def _nnx_create(resolved, seed):
  model = NnxMlp(resolved, nnx.Rngs(params=seed))
  return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _nnx_loss(model, batch, key):
  return jnp.mean((model(batch['x']) - batch['y']) ** 2)


@nnx.jit
def _nnx_train(model, optimizer, batch, dropout_base):
  loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch, None)
  optimizer.update(model, grads)
  return {'loss': loss}


@nnx.jit
def _nnx_eval(model, batch):
  return {'loss': _nnx_loss(model, batch, None)}


def _batch(step, split='train'):
  rng = np.random.default_rng([{'train': 0, 'eval': 1}[split], step])
  return {'x': rng.standard_normal((8, FEATURES), dtype=np.float32),
          'y': rng.standard_normal((8, 1), dtype=np.float32)}


def _pair(name, resolved, nnx_resolved=None, **kwargs):
  nnx_resolved = resolved if nnx_resolved is None else nnx_resolved

  def make_sides(mesh):
    return (parity.StockLinen(functools.partial(_linen_create, resolved), _linen_train, _linen_eval,
                              _linen_loss, mesh=mesh),
            parity.StockNnx(functools.partial(_nnx_create, nnx_resolved), _nnx_train, _nnx_eval, _nnx_loss,
                            mesh=mesh))
  return parity.Pair(name, make_sides, _batch, rules=(('batch', 'data'), ('hidden', None)), **kwargs)


def test_rules_with_a_hundred_logical_names_do_not_crash_the_specs_part():
  rules = tuple(ENCODER_RULES) + tuple((f'unused_{i}', None) for i in range(100))
  pair = dataclasses.replace(encoder.encoder, name='encoder_many_rules', rules=rules)
  lines = checks.check_specs(pair)
  assert any('the same logical names on both sides' in line for line in lines), lines


def test_named_constraints_are_compared_by_name():
  lines = checks.check_specs(_pair('named', resolved=False))
  assert lines == ['activation constraints: 2 per train step, the same logical names on both sides'], lines


def test_constraints_with_no_logical_name_are_never_a_silent_pass():
  with pytest.raises(AssertionError, match='nothing compared: the 2 activation constraints of each train step carry no logical name'):
    checks.check_specs(_pair('resolved', resolved=()))


def test_declared_resolved_constraints_are_compared_by_their_physical_specs():
  lines = checks.check_specs(_pair('resolved_declared', resolved=(), activations_resolved=True))
  assert lines == ['activation constraints: 2 per train step, resolved by the model itself (declared),'
                   ' the same physical specs on data=8'], lines


def test_declared_resolved_constraints_that_place_otherwise_fail():
  pair = _pair('resolved_apart', resolved=(), nnx_resolved=('data',), activations_resolved=True)
  with pytest.raises(AssertionError) as failure:
    checks.check_specs(pair)
  message = str(failure.value)
  assert 'resolve to other mesh axes on data=8' in message
  assert "physical Linen (None,None) vs NNX #0 ('data',None)" in message, message


def test_constraints_with_mesh_axes_undeclared_say_how_to_declare_them():
  with pytest.raises(AssertionError, match=r'name mesh axes, not logical names .*Pair\(activations_resolved=True\)'):
    checks.check_specs(_pair('mesh_axes', resolved=('data',)))
