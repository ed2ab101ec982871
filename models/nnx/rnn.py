"""A small recurrent language model from flax's stock NNX layers.

Mirrors models/linen/rnn.py class for class: `nnx.Embed`, `nnx.RNN` over an
`nnx.LSTMCell`, `nnx.Dropout` given its key at the call
(`rngs=nnx.Rngs(dropout=key)`), a linear head; the stock `nnx.Optimizer`
and adamw. `nnx.RNN` scans its cell with `nnx.scan`, which carries the
cell's parameters (and, backwards, their gradients) in another order than
Linen's `nn.RNN`: the same numbers, another loop (tests/test_family_rnn.py).
"""
from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx

import parity
from models.families import RnnConfig


class RecurrentLM(nnx.Module):

  def __init__(self, cfg: RnnConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.emb_dim, rngs=rngs)
    self.rnn = nnx.RNN(nnx.LSTMCell(cfg.emb_dim, cfg.hidden, rngs=rngs))
    self.dropout = nnx.Dropout(cfg.dropout_rate)
    self.head = nnx.Linear(cfg.hidden, cfg.vocab_size, rngs=rngs)

  def __call__(self, tokens, train: bool = False, rngs: nnx.Rngs | None = None):
    x = self.rnn(self.embed(tokens))
    x = self.dropout(x, deterministic=not train, rngs=rngs)
    return self.head(x)


def make_optimizer(cfg: RnnConfig) -> optax.GradientTransformation:
  return optax.adamw(cfg.learning_rate)


def create_train_state(cfg: RnnConfig, seed: int) -> tuple[RecurrentLM, nnx.Optimizer]:
  model = RecurrentLM(cfg, rngs=nnx.Rngs(params=seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)


def next_token_loss(logits, tokens):
  """Mean cross entropy of each position's logits against the next token."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def loss_fn(model: RecurrentLM, batch, dropout_key):
  tokens = batch['tokens']
  logits = model(tokens[:, :-1], train=True, rngs=nnx.Rngs(dropout=dropout_key))
  return next_token_loss(logits, tokens)


@nnx.jit
def train_step(model: RecurrentLM, optimizer: nnx.Optimizer, batch, dropout_base):
  key = parity.step_key(dropout_base, optimizer.step[...], 0)
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch, key)
  optimizer.update(model, grads)
  return {'loss': loss}


def forward(model: RecurrentLM, batch):
  """The model's eval-mode output (the logits), as the kit's eval part compares it."""
  return model(batch['tokens'][:, :-1], train=False)


@nnx.jit
def eval_step(model: RecurrentLM, batch):
  return {'loss': next_token_loss(forward(model, batch), batch['tokens'])}
