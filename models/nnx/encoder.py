"""A transformer encoder classifier from flax's stock NNX layers.

Mirrors models/linen/encoder.py: `nnx.Embed`, pre-norm layers of
`nnx.LayerNorm` + `nnx.MultiHeadAttention` + an `nnx.Linear` MLP, a final
norm, mean pooling and a linear head, trained with the stock
`nnx.Optimizer`. Token id 0 is padding and is masked out of attention.
Parameters and activations carry logical axis names (models/families.py).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import optax
from flax import nnx

import parity
from parity.core import compat
from models.families import ENCODER_ACTIVATION_AXES, ENCODER_AXES, EncoderConfig


def _axes(axes: str) -> dict:
  """Variable metadata with the parameter's logical axes (ENCODER_AXES)."""
  return compat.nnx_axes_metadata(ENCODER_AXES[axes])


def _constrain(x, axes: str):
  """The activation's logical axes (ENCODER_ACTIVATION_AXES); a no-op off a mesh."""
  return nn.with_logical_constraint(x, ENCODER_ACTIVATION_AXES[axes])


def _norm(cfg: EncoderConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(cfg.emb_dim, scale_metadata=_axes('norm'), bias_metadata=_axes('norm'), rngs=rngs)


def _linear(n_in: int, n_out: int, name: str, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, kernel_metadata=_axes(f'{name}_kernel'),
                    bias_metadata=_axes(f'{name}_bias'), rngs=rngs)


# 'linen': flax.linen's formula (the kit's stand-in), the substitution of the stock attention's difference.
ATTENTION_FNS = {'stock': nnx.dot_product_attention, 'linen': parity.linen_attention}


class EncoderLayer(nnx.Module):

  def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs):
    self.norm1 = _norm(cfg, rngs)
    self.attention = nnx.MultiHeadAttention(
        cfg.num_heads, cfg.emb_dim, qkv_features=cfg.emb_dim, decode=False,
        attention_fn=ATTENTION_FNS[cfg.nnx_attention], rngs=rngs,
        kernel_metadata=_axes('qkv_kernel'), bias_metadata=_axes('qkv_bias'),
        out_kernel_metadata=_axes('out_kernel'), out_bias_metadata=_axes('out_bias'),
    )
    self.norm2 = _norm(cfg, rngs)
    self.mlp_in = _linear(cfg.emb_dim, cfg.mlp_dim, 'mlp_in', rngs)
    self.mlp_out = _linear(cfg.mlp_dim, cfg.emb_dim, 'mlp_out', rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.norm1(x), mask=mask, deterministic=True)
    y = _constrain(nnx.gelu(self.mlp_in(self.norm2(x))), 'mlp')
    return _constrain(x + self.mlp_out(y), 'hidden')


class Encoder(nnx.Module):

  def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.emb_dim, embedding_metadata=_axes('embedding'), rngs=rngs)
    self.layers = nnx.List([EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = _norm(cfg, rngs)
    self.head = _linear(cfg.emb_dim, cfg.num_classes, 'head', rngs)

  def __call__(self, tokens):
    x = _constrain(self.embed(tokens), 'hidden')
    mask = nnx.make_attention_mask(tokens > 0, tokens > 0)
    for layer in self.layers:
      x = layer(x, mask)
    return self.head(jnp.mean(self.final_norm(x), axis=1))


def make_optimizer(cfg: EncoderConfig) -> optax.GradientTransformation:
  return optax.adamw(cfg.learning_rate)


def create_train_state(cfg: EncoderConfig, seed: int) -> tuple[Encoder, nnx.Optimizer]:
  model = Encoder(cfg, rngs=nnx.Rngs(params=seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def loss_fn(model: Encoder, batch, dropout_key):
  del dropout_key  # no dropout in this family
  return cross_entropy(model(batch['tokens']), batch['labels'])


@nnx.jit
def train_step(model: Encoder, optimizer: nnx.Optimizer, batch, dropout_base):
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch, dropout_base)
  optimizer.update(model, grads)
  return {'loss': loss}


def forward(model: Encoder, batch):
  """The model's eval-mode output (the logits), as the kit's eval part compares it."""
  return model(batch['tokens'])


@nnx.jit
def eval_step(model: Encoder, batch):
  logits = model(batch['tokens'])
  return {
      'loss': cross_entropy(logits, batch['labels']),
      'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['labels']),
  }
