"""A small recurrent language model from flax's stock Linen layers, and its train state.

Mirrors models/nnx/rnn.py: `nn.Embed`, `nn.RNN` over an `nn.LSTMCell`, stock
dropout drawing from `make_rng('dropout')`, a dense head; flax's stock
`TrainState` and adamw. Layers keep Linen's automatic names: the cell, made
in the model's scope and handed to `nn.RNN`, is `LSTMCell_0` beside `RNN_0`
(which owns no parameters), where NNX nests it as `rnn/cell`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import parity
from models.families import RnnConfig


class RecurrentLM(nn.Module):
  cfg: RnnConfig

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim)(tokens)
    x = nn.RNN(nn.LSTMCell(cfg.hidden))(x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)
    return nn.Dense(cfg.vocab_size)(x)


TrainState = train_state.TrainState


def make_optimizer(cfg: RnnConfig) -> optax.GradientTransformation:
  return optax.adamw(cfg.learning_rate)


def create_train_state(cfg: RnnConfig, seed: int) -> TrainState:
  model = RecurrentLM(cfg)
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, cfg.seq_len - 1), jnp.int32))['params']
  return TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(cfg))


def next_token_loss(logits, tokens):
  """Mean cross entropy of each position's logits against the next token."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def loss_fn(params, state: TrainState, batch, dropout_key):
  tokens = batch['tokens']
  logits = state.apply_fn({'params': params}, tokens[:, :-1], train=True, rngs={'dropout': dropout_key})
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
  return {'loss': next_token_loss(forward(state, batch), batch['tokens'])}
