"""A convolutional classifier from flax's stock NNX layers, and its train state.

Mirrors models/linen/classifier.py. Layers are named attributes (`conv1`,
`bn1`, ...); running statistics are `nnx.BatchStat` variables; the train
state is the stock `nnx.Optimizer(model, tx, wrt=nnx.Param)` and the step is
the stateful NNX idiom (`nnx.jit`, `nnx.value_and_grad`, `optimizer.update`).
Dropout draws its mask from an explicit key, as on the Linen side.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import rng
from models.families import ClassifierConfig


class Classifier(nnx.Module):

  def __init__(self, cfg: ClassifierConfig, *, rngs: nnx.Rngs):
    c1, c2 = cfg.channels
    self.conv1 = nnx.Conv(cfg.in_channels, c1, (3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(c1, momentum=cfg.batch_norm_momentum, rngs=rngs) if cfg.batch_norm else None
    self.conv2 = nnx.Conv(c1, c2, (3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(c2, momentum=cfg.batch_norm_momentum, rngs=rngs) if cfg.batch_norm else None
    self.dropout = nnx.Dropout(cfg.dropout_rate)
    self.head = nnx.Linear(c2, cfg.num_classes, rngs=rngs)

  def __call__(self, images, *, train: bool, dropout_key=None):
    x = images
    for conv, bn in ((self.conv1, self.bn1), (self.conv2, self.bn2)):
      x = conv(x)
      if bn is not None:
        x = bn(x, use_running_average=not train)
      x = nnx.relu(x)
      x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
    x = jnp.mean(x, axis=(1, 2))
    x = self.dropout(x, deterministic=not train, rngs=dropout_key)
    return self.head(x)


def make_optimizer(cfg: ClassifierConfig) -> optax.GradientTransformation:
  return optax.sgd(cfg.learning_rate, momentum=0.9)


def create_train_state(cfg: ClassifierConfig, seed: int) -> tuple[Classifier, nnx.Optimizer]:
  model = Classifier(cfg, rngs=nnx.Rngs(params=seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def loss_fn(model: Classifier, batch, dropout_key):
  """The loss in train mode (running statistics update in place)."""
  logits = model(batch['images'], train=True, dropout_key=dropout_key)
  return cross_entropy(logits, batch['labels'])


@nnx.jit
def train_step(model: Classifier, optimizer: nnx.Optimizer, batch, dropout_base):
  key = rng.step_key(dropout_base, optimizer.step[...], 0)
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch, key)
  optimizer.update(model, grads)
  return {'loss': loss}


@nnx.jit
def eval_step(model: Classifier, batch):
  logits = model(batch['images'], train=False)
  return {
      'loss': cross_entropy(logits, batch['labels']),
      'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['labels']),
  }
