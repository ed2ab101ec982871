"""A convolutional classifier from flax's stock Linen layers, and its train state.

Mirrors models/nnx/classifier.py. Layers keep Linen's automatic names
(`Conv_0`, `BatchNorm_0`, ...); the train state is flax's stock `TrainState`
with the `batch_stats` collection as an extra field (the flax docs' idiom).
Dropout draws its mask from an explicit key (`rng.step_key`), the same
function of (base key, step) on both sides, so masks can be equal.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from models import rng
from models.families import ClassifierConfig


class Classifier(nn.Module):
  cfg: ClassifierConfig

  @nn.compact
  def __call__(self, images, *, train: bool, dropout_key=None):
    cfg = self.cfg
    x = images
    for features in cfg.channels:
      x = nn.Conv(features, (3, 3))(x)
      if cfg.batch_norm:
        x = nn.BatchNorm(use_running_average=not train, momentum=cfg.batch_norm_momentum)(x)
      x = nn.relu(x)
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x, rng=dropout_key)
    return nn.Dense(cfg.num_classes)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any = None


def make_optimizer(cfg: ClassifierConfig) -> optax.GradientTransformation:
  return optax.sgd(cfg.learning_rate, momentum=0.9)


def create_train_state(cfg: ClassifierConfig, seed: int) -> TrainState:
  model = Classifier(cfg)
  images = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.in_channels), jnp.float32)
  variables = model.init(jax.random.PRNGKey(seed), images, train=False)
  return TrainState.create(
      apply_fn=model.apply,
      params=variables['params'],
      batch_stats=variables.get('batch_stats', {}),
      tx=make_optimizer(cfg),
  )


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def loss_fn(params, state: TrainState, batch, dropout_key):
  """(loss, updated batch_stats) in train mode."""
  logits, updates = state.apply_fn(
      {'params': params, 'batch_stats': state.batch_stats},
      batch['images'],
      train=True,
      dropout_key=dropout_key,
      mutable=['batch_stats'],
  )
  return cross_entropy(logits, batch['labels']), updates.get('batch_stats', {})


@jax.jit
def train_step(state: TrainState, batch, dropout_base):
  key = rng.step_key(dropout_base, state.step, 0)
  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params, state, batch, key
  )
  state = state.apply_gradients(grads=grads).replace(batch_stats=batch_stats)
  return state, {'loss': loss}


@jax.jit
def eval_step(state: TrainState, batch):
  logits = state.apply_fn(
      {'params': state.params, 'batch_stats': state.batch_stats}, batch['images'], train=False
  )
  return {
      'loss': cross_entropy(logits, batch['labels']),
      'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['labels']),
  }
