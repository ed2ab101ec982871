"""Modes and caches the way each framework sets them, through the model-level API.

The Linen model keeps `deterministic` and `decode` in its config (set by `clone` with a new
config, no keyword at the call); the NNX port is switched as flax NNX switches a model,
`model.train()` / `model.eval()` and `set_attributes(decode=True)`, its dropouts keeping their own
streams (no `rngs` at the call). A position embedding keeps its own cache index when decoding,
beside the stock attention's cache, on both sides. Neither model is subclassed for the kit: the
mode convention is the one `mode=` line of the glue.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parity


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 32
  emb_dim: int = 16
  num_heads: int = 2
  max_len: int = 16
  dropout_rate: float = 0.1
  deterministic: bool = False
  decode: bool = False


CFG = Config()
BATCH, LENGTH = 8, 8


def batch(step, split='train'):
  rng = np.random.default_rng([{'train': 0, 'eval': 1}[split], step])
  start = rng.integers(0, CFG.vocab_size, (BATCH, 1))
  stride = rng.integers(1, 4, (BATCH, 1))
  return {'tokens': ((start + stride * np.arange(LENGTH + 1)) % CFG.vocab_size).astype(np.int32)}


def next_token_loss(logits, b):
  return optax.softmax_cross_entropy_with_integer_labels(logits, b['tokens'][:, 1:]).mean()


# -- Linen: the modes in the config ----------------------------------------------------------------


class LinenPositionEmbs(nn.Module):
  """A learned position table; decoding, it keeps its own cache index and adds one row a call."""

  config: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    table = self.param('pos_embedding', nn.initializers.normal(0.02), (1, cfg.max_len, cfg.emb_dim))
    if cfg.decode:
      initialized = self.has_variable('cache', 'cache_index')
      index = self.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.uint32))
      if initialized:
        i = index.value
        index.value = i + 1
        return x + jax.lax.dynamic_slice(table, jnp.array((0, i, 0)), (1, 1, cfg.emb_dim))
    return x + table[:, :x.shape[1]]


class LinenLm(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim, name='embed')(tokens)
    x = LinenPositionEmbs(cfg, name='pos')(x)
    x = nn.Dropout(cfg.dropout_rate, name='embed_dropout')(x, deterministic=cfg.deterministic)
    mask = None if cfg.decode else nn.make_causal_mask(tokens)
    y = nn.MultiHeadDotProductAttention(cfg.num_heads, decode=cfg.decode, name='attention')(
        x, x, mask=mask, deterministic=cfg.deterministic)
    x = x + nn.Dropout(cfg.dropout_rate, name='attention_dropout')(y, deterministic=cfg.deterministic)
    return nn.Dense(cfg.vocab_size, name='head')(x)


# -- NNX: model.train() / model.eval(), set_attributes(decode=True) ------------------------------------


class NnxPositionEmbs(nnx.Module):
  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.pos_embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (1, config.max_len, config.emb_dim)))
    self.decode = False

  def __call__(self, x):
    table = self.pos_embedding[...]
    if self.decode:
      i = self.cache_index[...]
      self.cache_index[...] = i + 1
      return x + jax.lax.dynamic_slice(table, jnp.array((0, i, 0)), (1, 1, table.shape[-1]))
    return x + table[:, :x.shape[1]]

  def init_cache(self, input_shape, dtype=jnp.float32):
    self.cache_index = nnx.Cache(jnp.array(0, jnp.uint32))


class NnxLm(nnx.Module):
  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    self.embed = nnx.Embed(cfg.vocab_size, cfg.emb_dim, rngs=rngs)
    self.pos = NnxPositionEmbs(cfg, rngs=rngs)
    self.embed_dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(cfg.num_heads, cfg.emb_dim, rngs=rngs,  # decode=None, as flax leaves it
                                            attention_fn=parity.linen_attention)
    self.attention_dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    self.head = nnx.Linear(cfg.emb_dim, cfg.vocab_size, rngs=rngs)
    self.decode = False

  def __call__(self, tokens):
    x = self.embed_dropout(self.pos(self.embed(tokens)))
    mask = None if self.decode else nnx.make_causal_mask(tokens)
    x = x + self.attention_dropout(self.attention(x, x, mask=mask))
    return self.head(x)


# --- glue ---
modes = parity.model_pair(
    'modes', linen=LinenLm(CFG), nnx=lambda rngs: NnxLm(CFG, rngs=rngs), inputs=lambda b: b['tokens'][:, :-1],
    loss=next_token_loss, optimizer=optax.adam(1e-2), batch=batch, decode=parity.Decode(prompt=lambda b: b['tokens'][:, :3]),
    mode=(MODE := parity.Modes(linen=parity.Attribute('deterministic'), nnx='eval()')))
# --- end of glue ---


def test_the_models_are_left_in_the_mode_they_came_in():
  """The kit sets each mode for its call and puts it back: the NNX model a train or eval step
  leaves is in the mode it came in (its graph unchanged, so no step is traced anew), and the
  Linen model's config is never changed; the modes do reach the calls."""
  from parity.pairs import model_level

  common = dict(inputs=lambda b: b['tokens'][:, :-1], loss=next_token_loss, optimizer=optax.adam(1e-2), mode=MODE)
  code = model_level.nnx_model(lambda rngs: NnxLm(CFG, rngs=rngs), **common)
  model, optimizer = code.create(0)
  before = nnx.graphdef(model)
  data = {k: jnp.asarray(v) for k, v in batch(0).items()}
  code.train_step(model, optimizer, data, parity.base_key(0))
  code.eval_step(model, data)
  assert nnx.graphdef(model) == before and model.embed_dropout.deterministic is False
  train = code.loss(model, data, None)[0]
  assert not parity.bitwise_equal(train, code.loss(model, data, None)[0])  # dropout on: its streams advance
  assert parity.bitwise_equal(code.forward(model, data), code.forward(model, data))  # eval: deterministic

  linen = model_level.linen_model(LinenLm(CFG), batch=batch, **common)
  assert linen.model.config == CFG and linen.eval_model.config.deterministic and not linen.train_model.config.deterministic


class _NoCausalMask(NnxLm):
  """A planted bug: the NNX model's attention mask lets every token see every other."""

  def __call__(self, tokens):
    x = self.embed_dropout(self.pos(self.embed(tokens)))
    mask = None if self.decode else nnx.make_attention_mask(tokens >= 0, tokens >= 0)
    return self.head(x + self.attention_dropout(self.attention(x, x, mask=mask)))


def test_the_eval_localizer_names_the_mask_its_caller_made_otherwise():
  """The causal mask planted away on the NNX side: the eval part's localizer, as the train one,
  compares each call's arguments as it starts and names the model's own code and the `mask`
  argument, not the insides of the attention that received it."""
  from parity.battery import checks

  pair = parity.model_pair(
      'modes_mask', linen=LinenLm(CFG), nnx=lambda rngs: _NoCausalMask(CFG, rngs=rngs),
      inputs=lambda b: b['tokens'][:, :-1], loss=next_token_loss, optimizer=optax.adam(1e-2), batch=batch,
      mode=MODE, parts=('eval',))
  with pytest.raises(AssertionError) as failure:
    checks.check_eval(pair)
  message = str(failure.value)
  assert ('eval localizer: first differs inside module (model), outside its submodules (the input of attention'
          ' differs), run eagerly in eval mode (its argument mask:') in message, message


def test_a_mode_attribute_no_module_keeps_fails_at_create_naming_it():
  """`parity.Attribute('deterministic')` on an NNX model none of whose modules keeps it: refused at
  create, with the attribute named and the other conventions offered (not a mode silently unset)."""
  from parity.pairs import model_level

  class Plain(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  code = model_level.nnx_model(Plain, inputs=lambda b: b, loss=lambda y, b: y.sum(), optimizer=optax.sgd(0.1),
                               mode=parity.Attribute('deterministic'), dropout=None)
  with pytest.raises(TypeError, match=r"nnx_side: no module of Plain keeps deterministic, which its mode sets"):
    code.create(0)
