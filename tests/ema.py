"""An EMA of the parameters beside a family's stock train states, for the battery's tests.

A `TrainState` field (`ema_params`) against an `nnx.Optimizer` attribute
(`ema`), declared to the NNX side by `optimizer_fields`. The steps wrap the
family's own (`models/{linen,nnx}/<family>.py`: `create_train_state`,
`train_step`, `eval_step`, `loss_fn`); the eval steps evaluate the EMA.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import jax
from flax import nnx

from parity.pairs.stock import StockLinen, StockNnx

DECAY = 0.75
FIELDS = (('ema', 'ema_params'),)


def _is_variable(x):
  return isinstance(x, nnx.Variable)


def extended(state, cls, **extra):
  """`state` (a TrainState) as its subclass `cls`, with the fields `cls` adds set to `extra`."""
  return cls(**{f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, **extra)


@functools.cache
def _linen_steps(family: types.ModuleType):
  """(create, train step, eval step) over a Linen family's own, its TrainState given `ema_params`."""

  class EmaTrainState(family.TrainState):
    ema_params: object = None

  def create(cfg, seed):
    state = family.create_train_state(cfg, seed)
    return extended(state, EmaTrainState, ema_params=state.params)  # boxed as the parameters are

  @jax.jit
  def train_step(state, batch, dropout_base):
    state, metrics = family.train_step(state, batch, dropout_base)
    ema = jax.tree.map(lambda e, p: DECAY * e + (1 - DECAY) * p, state.ema_params, state.params)
    return state.replace(ema_params=ema), metrics

  def eval_step(state, batch):
    return family.eval_step(state.replace(params=state.ema_params), batch)

  return create, train_step, eval_step


def _nested(state):
  """An nnx State as nested dicts, its Variables kept."""
  return state if _is_variable(state) else {k: _nested(v) for k, v in state.items()}


@functools.cache
def _nnx_steps(family: types.ModuleType, keep_metadata: bool):
  def create(cfg, seed):
    model, optimizer = family.create_train_state(cfg, seed)
    params = nnx.state(model, nnx.Param)
    if keep_metadata:  # each copy keeps its parameter's metadata: its logical axes
      ema = _nested(jax.tree.map(lambda p: nnx.Variable(p[...], **p.get_metadata()), params,
                                 is_leaf=_is_variable))
    else:
      ema = jax.tree.map(lambda x: nnx.Variable(x), nnx.to_pure_dict(params))
    optimizer.ema = nnx.data(ema)
    return model, optimizer

  def train_step(model, optimizer, batch, dropout_base):
    metrics = family.train_step(model, optimizer, batch, dropout_base)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ema = jax.tree.map(lambda e, p: DECAY * e[...] + (1 - DECAY) * p, optimizer.ema, params,
                       is_leaf=_is_variable)
    jax.tree.map(lambda e, x: e.__setitem__(..., x), optimizer.ema, ema, is_leaf=_is_variable)
    return metrics

  def eval_step(model, optimizer, batch):
    nnx.update(model, jax.tree.map(lambda e: e[...], optimizer.ema, is_leaf=_is_variable))
    return family.eval_step(model, batch)

  return create, train_step, eval_step


def sides(linen_family, nnx_family, cfg, mesh, *, renames, rules=None, has_aux=False,
          fields=FIELDS, keep_metadata=True):
  """(StockLinen, StockNnx) over the family's steps with an EMA; `keep_metadata=False`:
  the NNX copies are made from the parameters' values alone (no logical axes)."""
  create, train_step, eval_step = _linen_steps(linen_family)
  linen = StockLinen(functools.partial(create, cfg), train_step, eval_step, linen_family.loss_fn,
                     has_aux=has_aux, mesh=mesh, rules=rules)
  create, train_step, eval_step = _nnx_steps(nnx_family, keep_metadata)
  nnx_side = StockNnx(functools.partial(create, cfg), train_step, eval_step, nnx_family.loss_fn,
                      renames=renames, mesh=mesh, rules=rules, optimizer_fields=fields,
                      eval_sees_optimizer=True)
  return linen, nnx_side
