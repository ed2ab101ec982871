"""The two implementations behind one interface, for the runner, CLI and tests.

A side's state is what its step functions take: a Linen `TrainState`, or the
pure NNX `State` of `(model, optimizer)` (its graphdef is fixed per side).
States cross between sides only through the bridge's checkpoint layout.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from bridge import layout as layout_lib
from bridge import train_state as bridge_state
from models.config import ModelConfig, TrainConfig
from models.linen import train as linen_train
from models.nnx import train as nnx_train


def as_jax_batch(batch: dict[str, Any]) -> dict[str, jax.Array]:
  return {k: jnp.asarray(v) for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class LinenSide:
  model_cfg: ModelConfig
  train_cfg: TrainConfig
  name: str = 'linen'

  def init(self, seed: int) -> linen_train.TrainState:
    variables = jax.jit(linen_train.init_variables, static_argnums=(0, 1, 2))(
        self.model_cfg, self.train_cfg, seed
    )
    return linen_train.create_train_state(self.model_cfg, self.train_cfg, variables)

  @functools.cached_property
  def abstract_variables(self) -> Any:
    """Boxed variables as ShapeDtypeStructs (nothing allocated)."""
    return jax.eval_shape(lambda: linen_train.init_variables(self.model_cfg, self.train_cfg, 0))

  @functools.cached_property
  def template(self) -> linen_train.TrainState:
    return jax.eval_shape(
        lambda: linen_train.create_train_state(
            self.model_cfg, self.train_cfg, nn.unbox(self.abstract_variables)
        )
    )

  def train_step(self, state, batch, dropout_base):
    return linen_train.make_train_step(self.model_cfg, self.train_cfg)(state, batch, dropout_base)

  def eval_step(self, state, batch):
    return linen_train.make_eval_step(self.model_cfg, self.train_cfg)(state.params, batch)

  def to_checkpoint(self, state) -> dict[str, Any]:
    return bridge_state.linen_to_checkpoint(state)

  def from_checkpoint(self, flat: dict[str, Any]) -> linen_train.TrainState:
    return bridge_state.checkpoint_to_linen(flat, self.template)

  def params(self, state) -> Any:
    return state.params

  def forward(self, state, batch, dropout_key):
    return _linen_forward(self.model_cfg, state.params, batch, dropout_key)

  def loss_and_grad(self, state, batch, dropout_key):
    """((loss_sum, (z_sum, tokens)), grads as Linen variables `{'params': ...}`)."""
    fn = linen_train.make_loss_and_grad(self.model_cfg, self.train_cfg)
    return fn(state.params, batch, dropout_key)


@dataclasses.dataclass(frozen=True)
class NnxSide:
  model_cfg: ModelConfig
  train_cfg: TrainConfig
  name: str = 'nnx'

  @property
  def layout(self) -> layout_lib.Layout:
    return layout_lib.layout_for(self.model_cfg)

  def _pair(self, seed: int):
    model = nnx_train.init_model(self.model_cfg, seed)
    return model, nnx.Optimizer(model, nnx_train.make_optimizer(self.train_cfg), wrt=nnx.Param)

  @functools.cached_property
  def _abstract(self):
    return nnx.split(nnx.eval_shape(lambda: self._pair(0)))

  @property
  def graphdef(self):
    return self._abstract[0]

  @property
  def template(self) -> nnx.State:
    return self._abstract[1]

  @functools.cached_property
  def abstract_params(self) -> nnx.State:
    """The Param state with metadata, as ShapeDtypeStructs (nothing allocated)."""
    return nnx.state(nnx.eval_shape(lambda: nnx_train.init_model(self.model_cfg, 0)), nnx.Param)

  def init(self, seed: int) -> nnx.State:
    @jax.jit
    def init_state():
      return nnx.state(self._pair(seed))

    return init_state()

  def train_step(self, state, batch, dropout_base):
    step = nnx_train.make_train_step(self.model_cfg, self.train_cfg)
    return step(self.graphdef, state, batch, dropout_base)

  def eval_step(self, state, batch):
    return nnx_train.make_eval_step(self.model_cfg, self.train_cfg)(self.graphdef, state, batch)

  def to_checkpoint(self, state) -> dict[str, Any]:
    return bridge_state.nnx_to_checkpoint(state, self.layout)

  def from_checkpoint(self, flat: dict[str, Any]) -> nnx.State:
    return bridge_state.checkpoint_to_nnx(flat, self.template, self.layout)

  def params(self, state) -> Any:
    model, _ = nnx.merge(self.graphdef, state)
    return nnx.state(model, nnx.Param)

  def forward(self, state, batch, dropout_key):
    return _nnx_forward(self.graphdef, state, batch, dropout_key)

  def loss_and_grad(self, state, batch, dropout_key):
    """((loss_sum, (z_sum, tokens)), grads as an NNX Param state)."""
    fn = nnx_train.make_loss_and_grad(self.model_cfg, self.train_cfg)
    return fn(self.graphdef, state, batch, dropout_key)


@functools.partial(jax.jit, static_argnums=0)
def _linen_forward(model_cfg, params, batch, dropout_key):
  return linen_train._forward(model_cfg, params, batch, dropout_key)


@functools.partial(jax.jit, static_argnums=0)
def _nnx_forward(graphdef, state, batch, dropout_key):
  model, _ = nnx.merge(graphdef, state)
  return nnx_train._forward(model, batch, dropout_key)


def make_sides(model_cfg: ModelConfig, train_cfg: TrainConfig) -> tuple[LinenSide, NnxSide]:
  return LinenSide(model_cfg, train_cfg), NnxSide(model_cfg, train_cfg)
