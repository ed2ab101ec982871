"""A small causal language model from flax's stock NNX layers.

Mirrors models/linen/lm.py class for class: `nnx.Embed`, pre-norm
`DecoderBlock`s (`nnx.LayerNorm`, `nnx.MultiHeadAttention` under
`nnx.make_causal_mask`, dropout, an `MlpBlock` of `nnx.Linear`), a final norm
and a linear head over the vocabulary, trained with the stock `nnx.Optimizer`
on next-token cross entropy. Layers are named attributes. Dropouts hold no
RNG state: the keys are passed at the call (`rngs=nnx.Rngs(dropout=key)`,
the kit's step key) and forwarded to each dropout. Parameters carry their
mesh axes, already resolved (`lm_axis_rules`, LM_RULES). The stock attention
(`jax.nn.dot_product_attention`) sums otherwise than Linen's even where its
scaling is exact: it vmaps over a query-group axis (here of size 1).

Decoding (`decode`) uses the stock attention's KV cache: a copy of the model
given `init_cache` (each attention's) and `set_attributes(decode=True)`, its
`nnx.Cache` variables written one token a call (the stock cache takes no
more), with no causal mask (the stock attention masks the slots past its
cache index itself).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx, traverse_util

import parity
from models.sampling import draw_tokens  # the same draws on both sides
from models.families import LmConfig, lm_axis_rules
from models.nnx.encoder import ATTENTION_FNS


def _init(init, *logical: str):
  return nnx.with_partitioning(init, lm_axis_rules(*logical))


class MlpBlock(nnx.Module):

  def __init__(self, cfg: LmConfig, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(cfg.emb_dim, cfg.mlp_dim, rngs=rngs,
                              kernel_init=_init(nnx.initializers.lecun_normal(), 'embed', 'mlp'))
    self.linear2 = nnx.Linear(cfg.mlp_dim, cfg.emb_dim, rngs=rngs,
                              kernel_init=_init(nnx.initializers.lecun_normal(), 'mlp', 'embed'))
    self.dropout = nnx.Dropout(cfg.dropout_rate)

  def __call__(self, x, train: bool, rngs: nnx.Rngs | None = None):
    x = self.dropout(nnx.gelu(self.linear1(x)), deterministic=not train, rngs=rngs)
    return self.dropout(self.linear2(x), deterministic=not train, rngs=rngs)


class DecoderBlock(nnx.Module):

  def __init__(self, cfg: LmConfig, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(cfg.emb_dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        cfg.num_heads, cfg.emb_dim, qkv_features=cfg.emb_dim, decode=False, rngs=rngs,
        attention_fn=ATTENTION_FNS[cfg.nnx_attention],
        kernel_init=_init(nnx.initializers.lecun_normal(), 'embed', 'heads'),
        out_kernel_init=_init(nnx.initializers.lecun_normal(), 'heads'),
        dropout_rate=cfg.attention_dropout_rate, keep_rngs=False,  # keys come at the call
    )
    self.dropout = nnx.Dropout(cfg.dropout_rate)
    self.ln2 = nnx.LayerNorm(cfg.emb_dim, rngs=rngs)
    self.mlp = MlpBlock(cfg, rngs=rngs)

  def __call__(self, x, mask, train: bool, rngs: nnx.Rngs | None = None):
    y = self.attention(self.ln1(x), mask=mask, deterministic=not train, rngs=rngs)
    x = x + self.dropout(y, deterministic=not train, rngs=rngs)
    return x + self.mlp(self.ln2(x), train, rngs)


class LanguageModel(nnx.Module):

  def __init__(self, cfg: LmConfig, *, rngs: nnx.Rngs):
    embedding_init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', out_axis=0)  # stock
    self.embed = nnx.Embed(cfg.vocab_size, cfg.emb_dim, rngs=rngs,
                           embedding_init=_init(embedding_init, 'vocab', 'embed'))
    self.blocks = nnx.List([DecoderBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = nnx.LayerNorm(cfg.emb_dim, rngs=rngs)
    self.head = nnx.Linear(cfg.emb_dim, cfg.vocab_size, rngs=rngs,
                           kernel_init=_init(nnx.initializers.lecun_normal(), 'embed', 'vocab'))
    self.decode = False  # True (set_attributes, after init_cache): one token a call through the cache

  def __call__(self, tokens, train: bool = False, rngs: nnx.Rngs | None = None):
    x = self.embed(tokens)
    mask = None if self.decode else nnx.make_causal_mask(tokens)  # decoding: the cache index masks
    for block in self.blocks:
      x = block(x, mask, train, rngs)
    return self.head(self.final_norm(x))

  def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
    """An empty KV cache in each attention, for `batch` rows of up to `max_len` tokens."""
    for block in self.blocks:
      block.attention.init_cache((batch, max_len, block.attention.in_features), dtype)


def make_optimizer(cfg: LmConfig) -> optax.GradientTransformation:
  return optax.adamw(cfg.learning_rate)


def create_train_state(cfg: LmConfig, seed: int) -> tuple[LanguageModel, nnx.Optimizer]:
  model = LanguageModel(cfg, rngs=nnx.Rngs(params=seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)


def next_token_loss(logits, tokens):
  """Mean cross entropy of each position's logits against the next token."""
  labels = tokens[:, 1:]
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def loss_fn(model: LanguageModel, batch, dropout_key):
  tokens = batch['tokens']
  logits = model(tokens[:, :-1], train=True, rngs=nnx.Rngs(dropout=dropout_key))
  return next_token_loss(logits, tokens)


@nnx.jit
def train_step(model: LanguageModel, optimizer: nnx.Optimizer, batch, dropout_base):
  key = parity.step_key(dropout_base, optimizer.step[...], 0)
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch, key)
  optimizer.update(model, grads)
  return {'loss': loss}


def forward(model: LanguageModel, batch):
  """The model's eval-mode output (the logits), as the kit's eval part compares it."""
  return model(batch['tokens'][:, :-1], train=False)


@nnx.jit
def eval_step(model: LanguageModel, batch):
  tokens = batch['tokens']
  return {'loss': next_token_loss(model(tokens[:, :-1], train=False), tokens)}


# -- decoding with the stock KV cache -----------------------------------------------------


def decoding_model(model: LanguageModel, batch: int, max_len: int) -> LanguageModel:
  """A copy of `model` (which is left as it is), decoding with an empty cache."""
  model = nnx.clone(model)
  model.init_cache(batch, max_len)
  model.set_attributes(decode=True)
  return model


def _apply_one(model: LanguageModel, token):
  """Logits [B, V] of one token a row, written in the cache at its index (in place)."""
  return model(token[:, None], train=False)[:, 0]


@nnx.jit
def prefill(model: LanguageModel, prompt):
  """Logits [B, P, V] at every prompt position, the prompt fed one position a call (scanned),
  as the stock cache takes it; the cache is updated in place. Compiled once per prompt length."""
  graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)

  def one(cache, token):
    model = nnx.merge(graphdef, cache, rest)
    logits = _apply_one(model, token)
    return nnx.state(model, nnx.Cache), logits

  cache, logits = jax.lax.scan(one, cache, prompt.T)
  nnx.update(model, cache)
  return jnp.swapaxes(logits, 0, 1)


@nnx.jit
def decode_step(model: LanguageModel, token):
  """Logits [B, V] after `token` int32[B]: one decoding step, the cache updated in place."""
  return _apply_one(model, token)


def decode(model: LanguageModel, prompt, steps: int, key, temperature: float):
  """`steps` tokens after `prompt` int32[B, P], with the stock KV cache, on a copy of `model`.

  Returns (int32[B, steps] tokens, float32[B, steps, V] the logits each was
  drawn from, the final cache as `{'<NNX path>/<name>': array}`). Token 0
  comes from the prefill's last position, token i from the step that fed
  token i - 1; the cache holds P + steps slots, the last one left empty (the
  last token is drawn, not fed).
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  batch, prompt_len = prompt.shape
  model = decoding_model(model, batch, prompt_len + steps)
  prompt_logits = prefill(model, prompt)
  tokens, drawn_from = draw_tokens(
      prompt_logits, lambda tokens_B1: decode_step(model, tokens_B1[:, 0])[:, None], steps, key, temperature)
  cache = nnx.to_pure_dict(nnx.state(model, nnx.Cache))
  return tokens, drawn_from, {'/'.join(map(str, path)): x for path, x in traverse_util.flatten_dict(cache).items()}
