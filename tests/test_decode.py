"""Decoding with a KV cache, Linen against NNX, bit for bit (models/*/decode.py, bridge/decode.py).

From one Linen init (`LinenSide.init(0)`) carried to NNX through the bridge,
both sides prefill a 16-token prompt and decode 32 tokens on the tiny preset
with dropout configured (rate 0.1; decoding turns it off) (scanned layers,
grouped-query attention), greedy and at temperature 0.8, on
one device and on the mesh fsdp=4,tensor=2: the tokens, every step's logits
and the final caches are bitwise equal, and the caches carry the same logical
axes and, on the mesh, the same shardings, the ones those axes give. The
unscanned model (the scanned one's parameters, unstacked) decodes alike
(greedy, one device).

Decoding is also checked against the training forward with dropout off on
each side (eval mode): the prefill's logits are the forward's, bit for bit, and the decoded logits
follow a forward over the whole decoded sequence (to a bfloat16 tolerance:
another program).

Each (placement, temperature) decodes once per process; the tests share an
xdist group, so one worker compiles each program once.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bridge import decode as bridge_decode
from bridge import layout
from bridge.sides import make_sides
from models.config import get_preset, replace
from models.linen import decode as linen_decode
from models.linen import train as linen_train
from models.nnx import decode as nnx_decode
from parity.core import bitwise, specs
from tests import tiers

pytestmark = pytest.mark.xdist_group(tiers.TINY_PRESET_GROUP)

BATCH, PROMPT_LEN, STEPS = 4, 16, 32
MESH = 'fsdp=4,tensor=2'
RULES = specs.DEFAULT_RULES + bridge_decode.CACHE_RULES
TEMPERATURES = (0.0, 0.8)
CACHE = 'cache/decoder/layers/self_attention/'


# Dropout configured, as a model decodes in production: decoding must switch it off (eval mode),
# which a rate of 0 would hide (a decoder left in train mode drops the same masks on both sides).
DROPOUT = 0.1


def _configs(scanned: bool = True):
  model_cfg, train_cfg = get_preset('tiny')
  model_cfg = replace(model_cfg, dropout_rate=DROPOUT)
  return (model_cfg if scanned else replace(model_cfg, scan_layers=False)), train_cfg


@functools.cache
def _eval_sides():
  """Sides of the tiny preset itself (dropout rate 0): their forward is what eval mode computes
  for the decoding model's parameters, whatever its configured rate."""
  return make_sides(*get_preset('tiny'))


@functools.cache
def _sides(mesh_spec: str | None, scanned: bool = True):
  if mesh_spec is None:
    return make_sides(*_configs(scanned))
  return make_sides(*_configs(scanned), specs.make_mesh(mesh_spec), RULES)


@functools.cache
def _states(mesh_spec: str | None, scanned: bool = True):
  """(Linen state, NNX state): one Linen init, carried to NNX by the bridge.

  The unscanned model's is the scanned model's init, its layers unstacked.
  """
  linen, nnx_side = _sides(mesh_spec, scanned)
  if scanned:
    state = linen.init(0)
  else:
    scanned_linen = _sides(mesh_spec)[0]
    flat = scanned_linen.to_checkpoint(_states(mesh_spec)[0])
    model_cfg = _configs()[0]
    state = linen.from_checkpoint(layout.unstack_layers(flat, model_cfg.num_layers, model_cfg.param_scan_axis))
  return state, nnx_side.from_checkpoint(linen.to_checkpoint(state))


@functools.cache
def _models(mesh_spec: str | None, scanned: bool = True):
  """(Linen variables, NNX model, prompt) of `_states`."""
  linen, nnx_side = _sides(mesh_spec, scanned)
  state, nnx_state = _states(mesh_spec, scanned)
  with nnx_side.context():
    model = nnx.merge(nnx_side.graphdef, nnx_state)[0]
  vocab = _configs()[0].vocab_size
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (BATCH, PROMPT_LEN), dtype=np.int32))
  if mesh_spec is not None:
    prompt = jax.device_put(prompt, linen.batch_sharding)
  return linen_train.model_variables(state), model, prompt


@functools.cache
def _decoded(mesh_spec: str | None, temperature: float, scanned: bool = True):
  """Each side's (tokens, logits, cache in the common layout)."""
  linen, nnx_side = _sides(mesh_spec, scanned)
  variables, model, prompt = _models(mesh_spec, scanned)
  model_cfg = _configs(scanned)[0]
  key = jax.random.PRNGKey(1)
  with linen.context():
    tokens, logits, cache = linen_decode.decode(model_cfg, variables, prompt, STEPS, key, temperature)
    out_linen = tokens, logits, bridge_decode.linen_cache(cache)
  with nnx_side.context():
    tokens, logits, cache = nnx_decode.decode(model_cfg, model, prompt, STEPS, key, temperature)
    out_nnx = tokens, logits, bridge_decode.nnx_cache(cache)
  return out_linen, out_nnx


CASES = [
    pytest.param(None, t, id=f'one_device-T{t}') for t in TEMPERATURES
] + [
    pytest.param(MESH, t, id=f'{MESH}-T{t}') for t in TEMPERATURES
]


@pytest.mark.parametrize(('mesh_spec', 'temperature'), CASES)
def test_decoding_is_bitwise_equal(mesh_spec, temperature):
  """Tokens, every step's logits and the final cache, Linen vs NNX."""
  out_linen, out_nnx = _decoded(mesh_spec, temperature)
  vocab = _configs()[0].vocab_size
  assert out_linen[0].shape == (BATCH, STEPS) and out_linen[0].dtype == jnp.int32
  assert out_linen[1].shape == (BATCH, STEPS, vocab) and out_linen[1].dtype == jnp.float32
  bitwise.assert_bitwise_equal(out_linen[0], out_nnx[0], 'decoded tokens')
  bitwise.assert_bitwise_equal(out_linen[1], out_nnx[1], 'decoded logits')
  bitwise.assert_bitwise_equal(out_linen[2], out_nnx[2], 'final caches')
  # The cache holds the prompt and every token fed back (all but the last drawn).
  index = np.asarray(out_linen[2][CACHE + 'cache_index'])
  assert index.tolist() == [PROMPT_LEN + STEPS - 1] * _configs()[0].num_layers


def test_unscanned_decoding_is_bitwise_equal():
  """The unscanned model (a cache per layer, `decoder/layers_<i>/...`), greedy, one device."""
  out_linen, out_nnx = _decoded(None, 0.0, scanned=False)
  assert sorted(out_linen[2]) == sorted(
      f'cache/decoder/layers_{i}/self_attention/{name}'
      for i in range(_configs()[0].num_layers) for name in bridge_decode.NAMES
  )
  for what, a, b in zip(('tokens', 'logits', 'caches'), out_linen, out_nnx):
    bitwise.assert_bitwise_equal(a, b, f'unscanned decoded {what}')


def test_greedy_takes_the_argmax_and_sampling_draws_otherwise():
  greedy, sampled = _decoded(None, 0.0)[0], _decoded(None, 0.8)[0]
  np.testing.assert_array_equal(greedy[0], np.argmax(greedy[1], axis=-1))
  assert (np.asarray(sampled[0]) != np.argmax(sampled[1], axis=-1)).any()


def test_cache_logical_axes_are_equal():
  """The caches' annotations, as each side declares them, in the common layout."""
  _, model, _ = _models(None)
  linen_specs = bridge_decode.linen_cache_specs(
      linen_decode.abstract_cache(_configs()[0], BATCH, PROMPT_LEN + STEPS)
  )
  nnx_specs = bridge_decode.nnx_cache_specs(nnx_decode.abstract_cache(model, BATCH, PROMPT_LEN + STEPS))
  axes = ('layers', 'cache_batch', 'cache_length', 'cache_kv_heads', 'cache_kv_head_dim')
  expected = {CACHE + 'cached_key': axes, CACHE + 'cached_value': axes, CACHE + 'cache_index': None}
  assert linen_specs == expected
  assert nnx_specs == expected


@pytest.mark.parametrize('temperature', TEMPERATURES)
def test_cache_placed_by_its_logical_axes_on_the_mesh(temperature):
  """On fsdp=4,tensor=2 both final caches sit where the rules put their logical axes."""
  out_linen, out_nnx = _decoded(MESH, temperature)
  linen, _ = _sides(MESH)
  specs_ = bridge_decode.linen_cache_specs(
      linen_decode.abstract_cache(_configs()[0], BATCH, PROMPT_LEN + STEPS)
  )
  targets = {
      p: nn.logical_to_mesh_sharding(jax.sharding.PartitionSpec(*(names or ())), linen.mesh, list(RULES))
      for p, names in specs_.items()
  }
  for side, cache in (('Linen', out_linen[2]), ('NNX', out_nnx[2])):
    for path, x in cache.items():
      assert x.sharding.is_equivalent_to(targets[path], x.ndim), (
          f'{side} {path}: {specs.describe_sharding(x.sharding)}, expected'
          f' {specs.describe_sharding(targets[path])}'
      )
  assert not out_linen[2][CACHE + 'cached_key'].sharding.is_fully_replicated


@functools.cache
def _prompt_batch():
  _, _, prompt = _models(None)
  positions = jnp.broadcast_to(jnp.arange(PROMPT_LEN, dtype=jnp.int32), prompt.shape)
  return {'inputs': prompt, 'positions': positions, 'segment_ids': jnp.ones_like(prompt)}


def test_prefill_logits_are_the_training_forwards():
  """Each side's prefill (decode mode, a cache of 48 slots, dropout configured) against its own
  training forward with dropout off (the tiny preset's rate is 0), bit for bit: decoding runs in
  eval mode. A decoder left in train mode drops here, on either side."""
  model_cfg = _configs()[0]
  assert model_cfg.dropout_rate > 0 and get_preset('tiny')[0].dropout_rate == 0.0
  linen, nnx_side = _eval_sides()
  variables, model, prompt = _models(None)
  linen_state, nnx_state = _states(None)
  key = jnp.zeros((2,), jnp.uint32)
  max_len = PROMPT_LEN + STEPS
  prefill_linen, _ = linen_decode.prefill(model_cfg, variables, prompt, max_len)
  prefill_nnx, _ = nnx_decode.prefill(model_cfg, model, prompt, max_len)
  bitwise.assert_bitwise_equal(linen.forward(linen_state, _prompt_batch(), key), prefill_linen, 'Linen logits')
  bitwise.assert_bitwise_equal(nnx_side.forward(nnx_state, _prompt_batch(), key), prefill_nnx, 'NNX logits')


def test_decoded_logits_follow_the_forward_of_the_decoded_sequence():
  """Step i's logits are the forward's at position PROMPT_LEN - 1 + i of prompt + tokens:
  the cache, its index and the positions do what a full causal forward does (Linen; the
  NNX side equals it bit for bit above), with dropout off."""
  linen, _ = _eval_sides()
  variables, _, prompt = _models(None)
  tokens, logits, _ = _decoded(None, 0.8)[0]
  sequence = jnp.concatenate([prompt, tokens], axis=1)
  length = sequence.shape[1]
  batch = {
      'inputs': sequence,
      'positions': jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), sequence.shape),
      'segment_ids': jnp.ones_like(sequence),
  }
  forward = linen.forward(_states(None)[0], batch, jnp.zeros((2,), jnp.uint32))
  expected = np.asarray(forward[:, PROMPT_LEN - 1:length - 1].astype(jnp.float32))
  # bfloat16 logits of magnitude < 8: a few units in the last place.
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=0.05)


@pytest.mark.exhaustive  # a planted bug (the localizer's run is eager: 37 s cold on 2 cores)
def test_a_cache_bug_mid_decode_is_localised_to_its_attention_and_step(monkeypatch):
  """The decode localizer on the reference decoder (unscanned, greedy, 4 tokens): run eagerly,
  every model call agrees; with the NNX attention's cache index skipping a slot once it
  reaches the prompt's end + 2, it names the first layer's attention and decode step 3."""
  from models.nnx import layers as nnx_layers
  from parity.compare import decode_localize

  sides, states = _sides(None, scanned=False), _states(None, scanned=False)
  prompt, key, steps = _models(None, scanned=False)[2], jax.random.PRNGKey(1), 4

  def localized():
    calls = [side.decode_calls(state, prompt, steps, key, 0.0) for side, state in zip(sides, states)]
    return decode_localize.localize_decode(*calls, steps)

  clean = localized()
  assert clean.first() is None and clean.model_calls == (steps, steps), clean.lines()
  assert clean.lines()[0].startswith('decode localizer: all 4 model calls of the decode'), clean.lines()

  write = nnx_layers.Attention._write_cache

  def skipping(self, k_BLKD, v_BLKD):
    index = self.cache_index[...]
    self.cache_index[...] = jnp.where(index == PROMPT_LEN + 2, index + 1, index)
    return write(self, k_BLKD, v_BLKD)

  monkeypatch.setattr(nnx_layers.Attention, '_write_cache', skipping)
  broken = localized()
  assert broken.first() == {'path': 'decoder/layers_0/self_attention', 'model_call': 3, 'step': 3}, broken.lines()
  assert ('first differs inside module decoder/layers_0/self_attention, outside its submodules (the input'
          ' of decoder/layers_0/self_attention/out differs), in model call 3 of 4: decode step 3 of 4'
          ' (it feeds token 2)') in broken.lines()[0], broken.lines()
