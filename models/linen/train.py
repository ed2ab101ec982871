"""Linen train state, loss, optimizer wiring, train and eval steps.

Mirrors models/nnx/train.py. The train state is flax's `TrainState` holding
the parameters' variables dict, so its parameter paths read `params/params/...`,
plus the fp8 scaling state (`fp8_meta`, empty without fp8). Steps are built
once per config (`functools.cache`) and jitted once.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.linen import fp8_ops
from flax.training import train_state

from models import rng
from models.config import ModelConfig, TrainConfig
from models.linen.decoder import Transformer

FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT


class TrainState(train_state.TrainState):
  """flax's TrainState plus `fp8_meta`: the `_overwrite_with_gradient` collection.

  flax's own TrainState can carry that collection inside `params` (its
  `apply_gradients` skips it), but then the optimizer state mirrors
  `params['params']` rather than `params`, and the checkpoint paths of Adam's
  moments would depend on the scenario. A field of its own keeps `params` =
  `{'params': ...}` and the optimizer state as in every other scenario; it is
  an empty dict (no leaves) without fp8.
  """

  fp8_meta: Any = struct.field(pytree_node=True, default_factory=dict)


def model_variables(state: TrainState) -> dict[str, Any]:
  """The variables dict `Transformer.apply` takes: parameters plus any fp8 state."""
  return _variables(state.params, state.fp8_meta)


def _variables(params, fp8_meta):
  return {**params, FP8_COLLECTION: fp8_meta} if fp8_meta else params


def make_optimizer(train_cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on linear warmup + cosine decay."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=train_cfg.learning_rate,
      warmup_steps=train_cfg.warmup_steps,
      decay_steps=train_cfg.decay_steps,
      end_value=train_cfg.learning_rate * train_cfg.end_learning_rate_ratio,
  )
  return optax.chain(
      optax.clip_by_global_norm(train_cfg.max_grad_norm),
      optax.adamw(
          schedule,
          b1=train_cfg.adam_b1,
          b2=train_cfg.adam_b2,
          eps=train_cfg.adam_eps,
          weight_decay=train_cfg.weight_decay,
      ),
  )


def init_variables(model_cfg: ModelConfig, train_cfg: TrainConfig, seed: int):
  """Boxed (logically partitioned) variables; wrap in jax.eval_shape for shapes only.

  With fp8 they include the `_overwrite_with_gradient` collection (not boxed:
  the scaling state is replicated).
  """
  shape = (1, train_cfg.seq_len)
  tokens = jnp.zeros(shape, jnp.int32)
  return Transformer(model_cfg).init(
      {'params': jax.random.PRNGKey(seed)},
      tokens, tokens, jnp.ones(shape, jnp.int32), rng.base_key(seed),
  )


def create_train_state(
    model_cfg: ModelConfig, train_cfg: TrainConfig, variables, *, unbox: bool = True
) -> TrainState:
  """A TrainState over the variables dict (`{'params': ...}`), unboxed by default.

  The fp8 collection, if any, goes to `fp8_meta`, out of the optimizer's reach.

  With `unbox=False` (under `jax.eval_shape`) the optimizer state inherits
  the parameters' logical-axis boxes, so `nn.get_partition_spec` gives the
  whole state's specs: the usual way to derive a Linen state's shardings.
  The step is an int32 array from the start (not a Python int), so the
  state's tree and the checkpoint layout do not change after the first step.
  """
  variables = nn.unbox(variables) if unbox else variables
  state = TrainState.create(
      apply_fn=Transformer(model_cfg).apply,
      params={k: v for k, v in variables.items() if k != FP8_COLLECTION},
      tx=make_optimizer(train_cfg),
      fp8_meta=variables.get(FP8_COLLECTION, {}),
  )
  return state.replace(step=jnp.zeros((), jnp.int32))


def cross_entropy_loss(logits_BLV, targets_BL, weights_BL, z_loss_weight):
  """Sums over real tokens of (cross-entropy + z-loss) and of z-loss alone."""
  logits_BLV = logits_BLV.astype(jnp.float32)
  lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  z_loss_BL = z_loss_weight * jnp.square(lse_BL)
  total_BL = (lse_BL - target_logit_BL + z_loss_BL) * weights_BL
  return jnp.sum(total_BL), jnp.sum(z_loss_BL * weights_BL)


def _forward(model_cfg: ModelConfig, variables, batch, dropout_key, deterministic=False):
  return Transformer(model_cfg, deterministic).apply(
      variables, batch['inputs'], batch['positions'], batch['segment_ids'], dropout_key
  )


def _loss_sum(model_cfg, train_cfg, params, fp8_meta, batch, dropout_key):
  logits_BLV = _forward(model_cfg, _variables(params, fp8_meta), batch, dropout_key)
  weights_BL = (batch['segment_ids'] != 0).astype(jnp.float32)
  loss_sum, z_sum = cross_entropy_loss(
      logits_BLV, batch['targets'], weights_BL, train_cfg.z_loss_weight
  )
  return loss_sum, (z_sum, jnp.sum(weights_BL))


@functools.cache
def make_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig):
  """The jitted `train_step(state, batch, dropout_base) -> (state, metrics)`.

  Gradients are sums over real tokens, accumulated over microbatches with a
  scan, then divided by the total token count: every token weighs the same
  however the batch is split.

  fp8 (delayed scaling): the fp8 ops' backward passes return each scale's and
  amax history's next value as its "gradient". That value replaces the state
  as is: it is not divided by the token count and the optimizer never sees it.
  """
  grad_fn = jax.value_and_grad(
      functools.partial(_loss_sum, model_cfg, train_cfg), argnums=(0, 1), has_aux=True
  )
  accum = train_cfg.grad_accum_steps
  if accum > 1 and model_cfg.quantization == 'fp8':
    raise NotImplementedError(
        'fp8 with gradient accumulation: the scaling state of each microbatch would be'
        ' summed, not overwritten'
    )

  def microbatch_grads(state, batch, dropout_base, microbatch):
    """((grads, loss_sum, z_sum, tokens), next fp8 state) of one microbatch."""
    key = rng.step_key(dropout_base, state.step, microbatch)
    (loss_sum, (z_sum, tokens)), (grads, fp8_meta) = grad_fn(
        state.params, state.fp8_meta, batch, key
    )
    return (grads, loss_sum, z_sum, tokens), fp8_meta

  def train_step(state: TrainState, batch, dropout_base):
    if accum == 1:
      (grads, loss_sum, z_sum, tokens), fp8_meta = microbatch_grads(
          state, batch, dropout_base, 0
      )
    else:
      microbatches = jax.tree.map(
          lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch
      )

      def accumulate(carry, inputs):
        microbatch, index = inputs
        out, _ = microbatch_grads(state, microbatch, dropout_base, index)
        return jax.tree.map(jnp.add, carry, out), None

      zero = jnp.zeros((), jnp.float32)
      init = (jax.tree.map(jnp.zeros_like, state.params), zero, zero, zero)
      (grads, loss_sum, z_sum, tokens), _ = jax.lax.scan(
          accumulate, init, (microbatches, jnp.arange(accum, dtype=jnp.uint32))
      )
      fp8_meta = state.fp8_meta  # empty: fp8 is refused with accumulation
    grads = jax.tree.map(lambda g: (g / tokens).astype(g.dtype), grads)
    new_state = state.apply_gradients(grads=grads, fp8_meta=fp8_meta)
    metrics = {'loss': loss_sum / tokens, 'z_loss': z_sum / tokens, 'tokens': tokens}
    return new_state, metrics

  return jax.jit(train_step)


@functools.cache
def make_eval_step(model_cfg: ModelConfig, train_cfg: TrainConfig):
  """The jitted `eval_step(state, batch) -> {loss, accuracy, tokens}` (dropout off).

  Mean loss (cross-entropy plus z-loss, as trained) and the fraction of real
  tokens whose argmax prediction is the target, both over real tokens, and
  their count. Reads the state, returns nothing of it: no parameter or fp8
  state changes.
  """

  def eval_step(state: TrainState, batch):
    logits_BLV = _forward(
        model_cfg, model_variables(state), batch, jnp.zeros((2,), jnp.uint32), True
    )
    weights_BL = (batch['segment_ids'] != 0).astype(jnp.float32)
    loss_sum, _ = cross_entropy_loss(
        logits_BLV, batch['targets'], weights_BL, train_cfg.z_loss_weight
    )
    correct_BL = (jnp.argmax(logits_BLV, axis=-1) == batch['targets']).astype(jnp.float32)
    tokens = jnp.sum(weights_BL)
    return {
        'loss': loss_sum / tokens,
        'accuracy': jnp.sum(correct_BL * weights_BL) / tokens,
        'tokens': tokens,
    }

  return jax.jit(eval_step)


@functools.cache
def make_loss_and_grad(model_cfg: ModelConfig, train_cfg: TrainConfig):
  """The jitted `(state, batch, dropout_key) -> ((loss_sum, (z_sum, tokens)), grads)`.

  Gradients of the parameters only (`{'params': ...}`), as the optimizer gets them.
  """
  grad_fn = jax.value_and_grad(
      functools.partial(_loss_sum, model_cfg, train_cfg), has_aux=True
  )

  def loss_and_grad(state: TrainState, batch, dropout_key):
    return grad_fn(state.params, state.fp8_meta, batch, dropout_key)

  return jax.jit(loss_and_grad)
