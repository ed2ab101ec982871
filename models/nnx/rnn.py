"""A small recurrent language model from flax's stock NNX layers.

Mirrors models/linen/rnn.py class for class: `nnx.Embed`, `nnx.RNN` over an
`nnx.LSTMCell` (or, with recurrent dropout, the model's `RecurrentDropoutLSTMCell`
around one, its dropout keeping its stream, which `nnx.RNN` carries, or broadcasts
with `recurrent_dropout_per_sequence`), `nnx.Dropout` given its key at the call
(`rngs=nnx.Rngs(dropout=key)`), a linear head; the stock `nnx.Optimizer`
and adamw. The train and eval steps are the language model's
(models/nnx/lm.py), which only call the model. `nnx.RNN` scans its cell
with `nnx.scan`, which carries the cell's parameters (and, backwards, their
gradients) in another order than Linen's `nn.RNN`: the same numbers,
another loop (tests/test_family_rnn.py).
"""
from __future__ import annotations

import optax
from flax import nnx

from models.families import RnnConfig
# The training code is the language model's: the same token batches, the same next-token loss,
# over whatever model is called with (tokens, train, rngs).
from models.nnx.lm import eval_step, forward, loss_fn, next_token_loss, train_step  # noqa: F401


class RecurrentDropoutLSTMCell(nnx.RNNCellBase):
  """flax's LSTM cell with its incoming hidden state dropped out at every step: the dropout keeps
  its stream (`nnx.RNN` calls a cell with no key), which the loop carries from step to step."""

  def __init__(self, in_features: int, features: int, rate: float, *, rngs: nnx.Rngs):
    self.dropout = nnx.Dropout(rate, rngs=rngs)
    self.lstm = nnx.LSTMCell(in_features, features, rngs=rngs)

  def __call__(self, carry, inputs):
    c, h = carry
    return self.lstm((c, self.dropout(h)), inputs)

  def initialize_carry(self, input_shape, rngs=None):
    return self.lstm.initialize_carry(input_shape, rngs)

  @property
  def num_feature_axes(self) -> int:
    return 1


class RecurrentLM(nnx.Module):

  def __init__(self, cfg: RnnConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.emb_dim, rngs=rngs)
    if cfg.recurrent_dropout_rate:
      cell = RecurrentDropoutLSTMCell(cfg.emb_dim, cfg.hidden, cfg.recurrent_dropout_rate, rngs=rngs)
    else:
      cell = nnx.LSTMCell(cfg.emb_dim, cfg.hidden, rngs=rngs)
    # One recurrent-dropout mask for every step (variational), as Linen's split_rngs={'dropout': False}.
    self.rnn = nnx.RNN(cell, broadcast_rngs='dropout' if cfg.recurrent_dropout_per_sequence else None)
    self.dropout = nnx.Dropout(cfg.dropout_rate)
    self.head = nnx.Linear(cfg.hidden, cfg.vocab_size, rngs=rngs)

  def __call__(self, tokens, train: bool = False, rngs: nnx.Rngs | None = None):
    cell = self.rnn.cell
    if isinstance(cell, RecurrentDropoutLSTMCell) and cell.dropout.deterministic != (not train):
      cell.dropout.deterministic = not train  # as Linen's cell is made; `train` wins over model.eval()
    x = self.rnn(self.embed(tokens))
    x = self.dropout(x, deterministic=not train, rngs=rngs)
    return self.head(x)


def make_optimizer(cfg: RnnConfig) -> optax.GradientTransformation:
  return optax.adamw(cfg.learning_rate)


def create_train_state(cfg: RnnConfig, seed: int) -> tuple[RecurrentLM, nnx.Optimizer]:
  # The recurrent dropout keeps a stream of its own (drawn from only where its rate is not 0).
  model = RecurrentLM(cfg, rngs=nnx.Rngs(params=seed, dropout=seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
