"""A small causal language model from flax's stock Linen layers.

Mirrors models/nnx/lm.py class for class: `nn.Embed`, pre-norm
`DecoderBlock`s (`nn.LayerNorm`, `nn.MultiHeadDotProductAttention` under
`nn.make_causal_mask`, dropout, an `MlpBlock` of `nn.Dense`), a final norm
and a dense head over the vocabulary, trained with the stock `TrainState` on
next-token cross entropy. Layers keep Linen's automatic names. Dropout draws
its keys the stock way (`make_rng('dropout')`), from `rngs={'dropout': key}`
with the kit's step key. Parameters carry logical axis names (LM_RULES).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import parity
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

  @nn.compact
  def __call__(self, x, mask, train: bool):
    cfg = self.cfg
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, qkv_features=cfg.emb_dim,
        kernel_init=_init(nn.initializers.lecun_normal(), 'embed', 'heads'),
        out_kernel_init=_init(nn.initializers.lecun_normal(), 'heads'),
    )(y, mask=mask)
    x = x + nn.Dropout(cfg.dropout_rate)(y, deterministic=not train)
    return x + MlpBlock(cfg)(nn.LayerNorm()(x), train)


class LanguageModel(nn.Module):
  cfg: LmConfig

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.cfg
    embedding_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal', out_axis=0)  # stock
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                 embedding_init=_init(embedding_init, 'vocab', 'embed'))(tokens)
    mask = nn.make_causal_mask(tokens)
    for _ in range(cfg.num_layers):
      x = DecoderBlock(cfg)(x, mask, train)
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
