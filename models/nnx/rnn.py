"""A small recurrent language model from flax's stock NNX layers.

Mirrors models/linen/rnn.py class for class: `nnx.Embed`, `nnx.RNN` over an
`nnx.LSTMCell`, `nnx.Dropout` given its key at the call
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
