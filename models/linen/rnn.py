"""A small recurrent language model from flax's stock Linen layers, and its train state.

Mirrors models/nnx/rnn.py: `nn.Embed`, `nn.RNN` over an `nn.LSTMCell` (or, with
recurrent dropout, the model's `RecurrentDropoutLSTMCell` around one, the key
split per step, or one key for every step: `recurrent_dropout_per_sequence`),
stock dropout drawing from `make_rng('dropout')`, a dense head; flax's stock
`TrainState` and adamw. The train and eval steps are the language model's
(models/linen/lm.py), which read only the state's `apply_fn`. Layers keep
Linen's automatic names: the cell, made in the model's scope and handed to
`nn.RNN`, is `LSTMCell_0` (or `RecurrentDropoutLSTMCell_0`) beside `RNN_0`
(which owns no parameters), where NNX nests it as `rnn/cell`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from models.families import RnnConfig
# The training code is the language model's: the same token batches, the same next-token loss,
# over whatever `apply_fn` the state holds.
from models.linen.lm import eval_step, forward, loss_fn, next_token_loss, train_step  # noqa: F401


class RecurrentDropoutLSTMCell(nn.RNNCellBase):
  """flax's LSTM cell with its incoming hidden state dropped out at every step, a mask per step:
  `nn.RNN` splits the 'dropout' key over the steps (`split_rngs`), each step's `make_rng` folds
  in the path and count."""
  features: int
  rate: float
  deterministic: bool = True

  @nn.compact
  def __call__(self, carry, inputs):
    c, h = carry
    h = nn.Dropout(self.rate)(h, deterministic=self.deterministic)
    return nn.LSTMCell(self.features)((c, h), inputs)

  @nn.nowrap
  def initialize_carry(self, rng, input_shape):
    return nn.LSTMCell(self.features, parent=None).initialize_carry(rng, input_shape)

  @property
  def num_feature_axes(self) -> int:
    return 1


class RecurrentLM(nn.Module):
  cfg: RnnConfig

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim)(tokens)
    if cfg.recurrent_dropout_rate:
      cell = RecurrentDropoutLSTMCell(cfg.hidden, cfg.recurrent_dropout_rate, deterministic=not train)
      per_step = not cfg.recurrent_dropout_per_sequence  # else one mask for every step
      x = nn.RNN(cell, split_rngs={'params': False, 'dropout': per_step})(x)
    else:
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
