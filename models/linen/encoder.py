"""A transformer encoder classifier from flax's stock Linen layers.

Mirrors models/nnx/encoder.py: `nn.Embed`, pre-norm layers of
`nn.LayerNorm` + `nn.MultiHeadDotProductAttention` + a `nn.Dense` MLP, a
final norm, mean pooling and a dense head, trained with the stock
`TrainState`. Token id 0 is padding and is masked out of attention.
Parameters and activations carry logical axis names (models/families.py).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from models.families import ENCODER_ACTIVATION_AXES, ENCODER_AXES, EncoderConfig


def _init(default, axes: str):
  """The stock layer's own initializer, with the parameter's logical axes (ENCODER_AXES)."""
  return nn.with_logical_partitioning(default, ENCODER_AXES[axes])


def _constrain(x, axes: str):
  """The activation's logical axes (ENCODER_ACTIVATION_AXES); a no-op off a mesh."""
  return nn.with_logical_constraint(x, ENCODER_ACTIVATION_AXES[axes])


def _norm():
  return nn.LayerNorm(scale_init=_init(nn.LayerNorm.scale_init, 'norm'),
                      bias_init=_init(nn.LayerNorm.bias_init, 'norm'))


def _dense(features: int, name: str):
  return nn.Dense(features, kernel_init=_init(nn.Dense.kernel_init, f'{name}_kernel'),
                  bias_init=_init(nn.Dense.bias_init, f'{name}_bias'))


class EncoderLayer(nn.Module):
  cfg: EncoderConfig

  @nn.compact
  def __call__(self, x, mask):
    cfg = self.cfg
    mha = nn.MultiHeadDotProductAttention
    y = _norm()(x)
    y = mha(
        num_heads=cfg.num_heads, qkv_features=cfg.emb_dim,
        kernel_init=_init(mha.kernel_init, 'qkv_kernel'), bias_init=_init(mha.bias_init, 'qkv_bias'),
        out_kernel_init=_init(mha.kernel_init, 'out_kernel'),
        out_bias_init=_init(mha.bias_init, 'out_bias'),
    )(y, mask=mask, deterministic=True)
    x = x + y
    y = _norm()(x)
    y = _dense(cfg.mlp_dim, 'mlp_in')(y)
    y = _constrain(nn.gelu(y), 'mlp')
    return _constrain(x + _dense(cfg.emb_dim, 'mlp_out')(y), 'hidden')


class Encoder(nn.Module):
  cfg: EncoderConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                 embedding_init=_init(nn.Embed.embedding_init, 'embedding'))(tokens)
    x = _constrain(x, 'hidden')
    mask = nn.make_attention_mask(tokens > 0, tokens > 0)
    for i in range(cfg.num_layers):
      x = EncoderLayer(cfg, name=f'layers_{i}')(x, mask)
    x = _norm()(x)
    return _dense(cfg.num_classes, 'head')(jnp.mean(x, axis=1))


TrainState = train_state.TrainState


def make_optimizer(cfg: EncoderConfig) -> optax.GradientTransformation:
  return optax.adamw(cfg.learning_rate)


def create_train_state(cfg: EncoderConfig, seed: int) -> TrainState:
  model = Encoder(cfg)
  tokens = jnp.ones((1, cfg.seq_len), jnp.int32)
  params = model.init(jax.random.PRNGKey(seed), tokens)['params']
  return TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(cfg))


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def loss_fn(params, state: TrainState, batch, dropout_key):
  del dropout_key  # no dropout in this family
  logits = state.apply_fn({'params': params}, batch['tokens'])
  return cross_entropy(logits, batch['labels'])


@jax.jit
def train_step(state: TrainState, batch, dropout_base):
  loss, grads = jax.value_and_grad(loss_fn)(state.params, state, batch, dropout_base)
  return state.apply_gradients(grads=grads), {'loss': loss}


def forward(state: TrainState, batch):
  """The model's eval-mode output (the logits), as the kit's eval part compares it."""
  return state.apply_fn({'params': state.params}, batch['tokens'])


@jax.jit
def eval_step(state: TrainState, batch):
  logits = state.apply_fn({'params': state.params}, batch['tokens'])
  return {
      'loss': cross_entropy(logits, batch['labels']),
      'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['labels']),
  }
