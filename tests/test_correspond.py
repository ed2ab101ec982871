"""Module correspondences inferred by the kit, and Linen's dropout keys reproduced.

The classifier's and the encoder's pairs give no renames: the inferred table
must be the one written by hand before (each family's RENAMES), path for path.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parity
from parity.core import compat, paths, rng
from parity.pairs import correspond
from parity.run import cli
from tests import test_family_classifier as classifier
from tests import test_family_encoder as encoder


def _inferred(pair):
  linen, nnx_side = pair.make_sides(None)
  return nnx_side.correspondence(linen, pair.batch(0, 'train'), rng.step_key(rng.base_key(0), 0, 0))


@pytest.mark.parametrize('family', [classifier, encoder], ids=['classifier', 'encoder'])
def test_the_inferred_table_is_the_one_written_by_hand(family):
  pair = family.classifier if family is classifier else family.encoder
  found = _inferred(pair)
  linen, _ = pair.make_sides(None)
  modules = set()
  for path in paths.flatten(linen.template.params):
    parts = path.split('/')
    modules.update('/'.join(parts[:i]) for i in range(1, len(parts) + 1))
  differ = [(m, family.RENAMES.to_nnx(m), found.renames.to_nnx(m)) for m in sorted(modules)
            if family.RENAMES.to_nnx(m) != found.renames.to_nnx(m)]
  assert not differ, differ
  assert found.call_keys == ()


def test_a_users_rule_wins_where_it_speaks():
  pair = classifier.classifier
  linen, nnx_side = pair.make_sides(None)
  given = dataclasses.replace(nnx_side, renames=parity.Renames((('Dense_0', 'head'),)))
  found = given.correspondence(linen, pair.batch(0, 'train'), rng.step_key(rng.base_key(0), 0, 0))
  assert found.renames.rules[0] == ('Dense_0', 'head')
  assert ('Dense_0', 'head') not in found.inferred and ('Conv_0', 'conv1') in found.inferred


def _call(key, cls, own=(), below=None):
  below = tuple(sorted((s, d) for _, s, d in own)) if below is None else below
  return correspond.Call(key, key.split('#')[0], cls, tuple(own), below, frozenset({cls}))


def test_one_nnx_module_called_twice_pairs_call_by_call_with_two_linen_modules():
  kernel = (('kernel', (4, 4), 'float32'),)
  linen = [_call('mlp/Dense_0', 'Dense', kernel), _call('mlp/Dropout_0', 'Dropout'),
           _call('mlp/Dense_1', 'Dense', kernel), _call('mlp/Dropout_1', 'Dropout'),
           _call('mlp', 'Mlp', below=((((4, 4)), 'float32'),) * 2)]
  nnx_ = [_call('block/up', 'Linear', kernel), _call('block/drop', 'Dropout'),
          _call('block/down', 'Linear', kernel), _call('block/drop#1', 'Dropout'),
          _call('block', 'Block', below=((((4, 4)), 'float32'),) * 2)]
  found = correspond.infer(linen, nnx_)
  assert found.renames.to_nnx('mlp/Dense_1/kernel') == 'block/down/kernel'
  assert found.renames.to_linen('block/drop') == 'mlp/Dropout_0'
  assert found.call_keys == (('mlp/Dropout_0#1', 'mlp/Dropout_1'),)


def test_a_module_with_no_counterpart_is_named_with_its_candidates():
  kernel = (('kernel', (4, 4), 'float32'),)
  other = (('kernel', (4, 8), 'float32'),)
  linen = [_call('Dense_0', 'Dense', kernel), _call('Dense_1', 'Dense', kernel)]
  nnx_ = [_call('up', 'Linear', kernel), _call('wide', 'Linear', other)]
  with pytest.raises(correspond.CorrespondenceError) as e:
    correspond.infer(linen, nnx_)
  message = str(e.value)
  assert 'Linen Dense_1 (Dense): no NNX module matched; candidates: up (Linear)' in message
  assert 'NNX wide (Linear): no Linen module matched; candidates: none' in message


@pytest.mark.parametrize('spec', ['tests/test_family_classifier.py:classifier', 'tests/test_family_encoder.py:encoder'])
def test_parity_renames_prints_the_table_as_python(spec, capsys):
  assert cli.main(['renames', '--pair', spec]) == 0
  out = capsys.readouterr().out
  table = out.split('\n', 1)[1]
  namespace = {'parity': parity}
  exec(table, namespace)  # pastes as it prints
  family = classifier if 'classifier' in spec else encoder
  assert set(namespace['RENAMES'].rules) <= set(family.RENAMES.rules) | {
      (l, n) for l, n in namespace['RENAMES'].rules if family.RENAMES.to_nnx(l) == n}


class _Draws(nn.Module):
  @nn.compact
  def __call__(self, x):
    return self.make_rng('dropout'), self.make_rng('dropout')


class _Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _Draws(name='inner')(x), nn.Dropout(0.5, deterministic=False)(x)


def test_linens_make_rng_keys_are_reproduced_bit_for_bit():
  key = rng.step_key(rng.base_key(3), 5, 0)
  (first, second), dropped = _Outer().apply({}, jnp.ones((64,)), rngs={'dropout': key})
  parity.assert_bitwise_equal(first, compat.linen_make_rng(key, ['inner'], 1))
  parity.assert_bitwise_equal(second, compat.linen_make_rng(key, ['inner'], 2))
  drawn = nnx.Dropout(0.5)(jnp.ones((64,)), deterministic=False, rngs=compat.linen_make_rng(key, ['Dropout_0'], 1))
  parity.assert_bitwise_equal(dropped, drawn)
  assert not np.array_equal(np.asarray(first), np.asarray(second))


class _TwoDropouts(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dropout(0.5, deterministic=False)(x)
    return nn.Dropout(0.5, deterministic=False)(x * 3.0)


class _OneDropoutTwice(nnx.Module):
  def __init__(self):
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs):
    x = self.drop(x, deterministic=False, rngs=rngs)
    return self.drop(x * 3.0, deterministic=False, rngs=rngs)


def test_nnx_dropout_given_rngs_at_the_call_draws_linens_masks():
  """One nnx.Dropout called twice with nnx.Rngs against Linen's Dropout_0 and Dropout_1."""
  from parity.compare import scopes
  from parity.pairs import dropout

  key = rng.step_key(rng.base_key(0), 1, 0)
  x = jnp.arange(1.0, 257.0)
  linen = _TwoDropouts().apply({}, x, rngs={'dropout': key})
  model = _OneDropoutTwice()
  as_drawn = model(x, nnx.Rngs(dropout=key))
  assert not np.array_equal(np.asarray(as_drawn), np.asarray(linen))  # NNX's own keys: other masks
  scopes.tag_paths(model, {'drop': 'Dropout_0'}.get)
  with dropout.linen_dropout_keys({'Dropout_0#1': 'Dropout_1'}) as substituted:
    parity.assert_bitwise_equal(jax.jit(lambda x: model(x, nnx.Rngs(dropout=key)))(x), linen)
  assert dict(substituted) == {'Dropout_0': 1, 'Dropout_1': 1}
  parity.assert_bitwise_equal(model(x, nnx.Rngs(dropout=key)), as_drawn)  # restored on exit


def test_parity_renames_of_the_language_model_names_its_reused_dropout_call_by_call(capsys):
  """The fourth family: automatic Linen names against NNX attributes, one NNX dropout called
  twice where Linen's MLP has two."""
  assert cli.main(['renames', '--pair', 'tests/test_family_lm.py:lm']) == 0
  out = capsys.readouterr().out
  for rule in ["('Embed_0', 'embed')", "('DecoderBlock_1', 'blocks/1')",
               "('DecoderBlock_0/MlpBlock_0/Dense_1', 'blocks/0/mlp/linear2')", "('Dense_0', 'head')"]:
    assert rule in out, out
  assert '#   DecoderBlock_0/MlpBlock_0/Dropout_0#1 -> DecoderBlock_0/MlpBlock_0/Dropout_1' in out, out
