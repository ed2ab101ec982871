"""A small causal language model from flax's stock Linen layers.

Mirrors models/nnx/lm.py class for class: `nn.Embed`, pre-norm
`DecoderBlock`s (`nn.LayerNorm`, `nn.MultiHeadDotProductAttention` under
`nn.make_causal_mask`, dropout, an `MlpBlock` of `nn.Dense`), a final norm
and a dense head over the vocabulary, trained with the stock `TrainState` on
next-token cross entropy. Layers keep Linen's automatic names. Dropout draws
its keys the stock way (`make_rng('dropout')`), from `rngs={'dropout': key}`
with the kit's step key. Parameters carry logical axis names (LM_RULES).

Decoding (`decode`) uses the stock attention's KV cache: the model built with
`decode=True`, its 'cache' collection made by an `init` at the full length
and carried through `apply(..., mutable=['cache'])`, one token a call (the
stock cache takes no more), with no causal mask (the stock attention masks
the slots past its cache index itself).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from flax.core import meta
from flax.training import train_state

import parity
from models.sampling import draw_tokens  # the same draws on both sides
from models.families import LmConfig


def _init(init, *logical: str):
  return nn.with_logical_partitioning(init, logical)


class MlpBlock(nn.Module):
  cfg: LmConfig

  @nn.compact
  def __call__(self, x, train: bool):
    cfg = self.cfg
    x = nn.Dense(cfg.mlp_dim, kernel_init=_init(nn.initializers.lecun_normal(), 'embed', 'mlp'))(x)
    x = nn.Dropout(cfg.dropout_rate)(nn.gelu(x), deterministic=not train)
    x = nn.Dense(cfg.emb_dim, kernel_init=_init(nn.initializers.lecun_normal(), 'mlp', 'embed'))(x)
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)


class DecoderBlock(nn.Module):
  cfg: LmConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x, mask, train: bool):
    cfg = self.cfg
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, qkv_features=cfg.emb_dim,
        kernel_init=_init(nn.initializers.lecun_normal(), 'embed', 'heads'),
        out_kernel_init=_init(nn.initializers.lecun_normal(), 'heads'),
        decode=self.decode, dropout_rate=cfg.attention_dropout_rate,
    )(y, mask=mask, deterministic=not train)
    x = x + nn.Dropout(cfg.dropout_rate)(y, deterministic=not train)
    return x + MlpBlock(cfg)(nn.LayerNorm()(x), train)


class LanguageModel(nn.Module):
  cfg: LmConfig
  decode: bool = False  # True: one token a call through the 'cache' collection (`decode`)

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.cfg
    embedding_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal', out_axis=0)  # stock
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                 embedding_init=_init(embedding_init, 'vocab', 'embed'))(tokens)
    mask = None if self.decode else nn.make_causal_mask(tokens)  # decoding: the cache index masks
    for _ in range(cfg.num_layers):
      x = DecoderBlock(cfg, decode=self.decode)(x, mask, train)
    x = nn.LayerNorm()(x)
    head_init = _init(nn.initializers.lecun_normal(), 'embed', 'vocab')
    return nn.Dense(cfg.vocab_size, kernel_init=head_init)(x)


TrainState = train_state.TrainState


def make_optimizer(cfg: LmConfig) -> optax.GradientTransformation:
  return optax.adamw(cfg.learning_rate)


def create_train_state(cfg: LmConfig, seed: int) -> TrainState:
  model = LanguageModel(cfg)
  tokens = jnp.ones((1, cfg.seq_len - 1), jnp.int32)
  variables = model.init(jax.random.PRNGKey(seed), tokens)
  return TrainState.create(apply_fn=model.apply, params=variables['params'], tx=make_optimizer(cfg))


def next_token_loss(logits, tokens):
  """Mean cross entropy of each position's logits against the next token."""
  labels = tokens[:, 1:]
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def loss_fn(params, state: TrainState, batch, dropout_key):
  tokens = batch['tokens']
  logits = state.apply_fn({'params': params}, tokens[:, :-1], train=True,
                          rngs={'dropout': dropout_key})
  return next_token_loss(logits, tokens)


@jax.jit
def train_step(state: TrainState, batch, dropout_base):
  key = parity.step_key(dropout_base, state.step, 0)
  loss, grads = jax.value_and_grad(loss_fn)(state.params, state, batch, key)
  return state.apply_gradients(grads=grads), {'loss': loss}


def forward(state: TrainState, batch):
  """The model's eval-mode output (the logits), as the kit's eval part compares it."""
  return state.apply_fn({'params': state.params}, batch['tokens'][:, :-1], train=False)


@jax.jit
def eval_step(state: TrainState, batch):
  tokens = batch['tokens']
  logits = state.apply_fn({'params': state.params}, tokens[:, :-1], train=False)
  return {'loss': next_token_loss(logits, tokens)}


# -- decoding with the stock KV cache -----------------------------------------------------


def decoding_model(state: TrainState) -> LanguageModel:
  """The model of `state` (`create_train_state`'s: its apply_fn is the model's apply), decoding."""
  model = getattr(state.apply_fn, '__self__', None)
  if not isinstance(model, LanguageModel):
    raise TypeError(f"decode: the state's apply_fn is not a LanguageModel's apply: {state.apply_fn!r}")
  return model.clone(decode=True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def init_cache(model: LanguageModel, batch: int, max_len: int):
  """The decoding model's empty 'cache' collection for `batch` rows of up to `max_len` tokens:
  flax's idiom, an `init` at the full length (in jit: the parameters' init is pruned)."""
  return model.init(jax.random.PRNGKey(0), jnp.zeros((batch, max_len), jnp.int32), train=False)['cache']


def _apply_one(model: LanguageModel, params, cache, token):
  """(logits [B, V] of one token a row, the cache after): written at the cache index."""
  logits, mutated = model.apply({'params': params, 'cache': cache}, token[:, None], train=False,
                                mutable=['cache'])
  return logits[:, 0], mutated['cache']


@functools.partial(jax.jit, static_argnums=0)
def prefill(model: LanguageModel, params, cache, prompt):
  """(logits [B, P, V] at every prompt position, the cache after): the prompt fed one position
  a call (scanned), as the stock cache takes it. Compiled once per prompt length."""

  def one(cache, token):
    logits, cache = _apply_one(model, params, cache, token)
    return cache, logits

  cache, logits = jax.lax.scan(one, cache, prompt.T)
  return jnp.swapaxes(logits, 0, 1), cache


@functools.partial(jax.jit, static_argnums=0)
def decode_step(model: LanguageModel, params, cache, token):
  """(logits [B, V] after `token` int32[B], the cache after): one decoding step."""
  return _apply_one(model, params, cache, token)


def decode(state: TrainState, prompt, steps: int, key, temperature: float):
  """`steps` tokens after `prompt` int32[B, P], with the stock KV cache.

  Returns (int32[B, steps] tokens, float32[B, steps, V] the logits each was
  drawn from, the final cache as `{'<module path>/<name>': array}`). Token 0
  comes from the prefill's last position, token i from the step that fed
  token i - 1; the cache holds P + steps slots, the last one left empty (the
  last token is drawn, not fed). `state.params` may be boxed or plain arrays.
  """
  model = decoding_model(state)
  params = meta.unbox(state.params)
  prompt = jnp.asarray(prompt, jnp.int32)
  batch, prompt_len = prompt.shape
  cache = init_cache(model, batch, prompt_len + steps)
  prompt_logits, cache = prefill(model, params, cache, prompt)

  def feed(tokens_B1):
    nonlocal cache
    logits, cache = decode_step(model, params, cache, tokens_B1[:, 0])
    return logits[:, None]

  tokens, drawn_from = draw_tokens(prompt_logits, feed, steps, key, temperature)
  return tokens, drawn_from, traverse_util.flatten_dict(cache, sep='/')
