"""NNX train state, loss, optimizer wiring, train and eval steps.

Mirrors models/linen/train.py. The train state is `nnx.Optimizer(model, tx,
wrt=nnx.Param)`. Steps take pure pytrees: the caller splits (model,
optimizer) into a graphdef and a state once, outside the loop, and the
jitted step merges inside, so no Python graph traversal happens per step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import rng
from models.config import ModelConfig, TrainConfig
from models.nnx.decoder import Transformer
from models.nnx.layers import Fp8Meta


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


def init_model(model_cfg: ModelConfig, seed: int) -> Transformer:
  """A freshly initialised model; wrap in nnx.eval_shape for shapes only."""
  return Transformer(model_cfg, rngs=nnx.Rngs(params=seed))


def create_train_state(model_cfg: ModelConfig, train_cfg: TrainConfig, model: Transformer):
  """(graphdef, state) of (model, optimizer): the pure form the steps take."""
  del model_cfg  # the model carries its config
  optimizer = nnx.Optimizer(model, make_optimizer(train_cfg), wrt=nnx.Param)
  return nnx.split((model, optimizer))


def cross_entropy_loss(logits_BLV, targets_BL, weights_BL, z_loss_weight):
  """Sums over real tokens of (cross-entropy + z-loss) and of z-loss alone."""
  logits_BLV = logits_BLV.astype(jnp.float32)
  lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  z_loss_BL = z_loss_weight * jnp.square(lse_BL)
  total_BL = (lse_BL - target_logit_BL + z_loss_BL) * weights_BL
  return jnp.sum(total_BL), jnp.sum(z_loss_BL * weights_BL)


def _forward(model: Transformer, batch, dropout_key):
  return model(batch['inputs'], batch['positions'], batch['segment_ids'], dropout_key)


def _loss_sum(train_cfg, model, batch, dropout_key):
  logits_BLV = _forward(model, batch, dropout_key)
  weights_BL = (batch['segment_ids'] != 0).astype(jnp.float32)
  loss_sum, z_sum = cross_entropy_loss(
      logits_BLV, batch['targets'], weights_BL, train_cfg.z_loss_weight
  )
  return loss_sum, (z_sum, jnp.sum(weights_BL))


@functools.cache
def make_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig):
  """The jitted `train_step(graphdef, state, batch, dropout_base) -> (state, metrics)`.

  Gradients are sums over real tokens, accumulated over microbatches with a
  scan, then divided by the total token count: every token weighs the same
  however the batch is split.

  fp8 (delayed scaling): the `Fp8Meta` variables are differentiated too; the
  fp8 ops' backward passes return each scale's and amax history's next value
  as its "gradient". That value overwrites the variable as is: it is not
  divided by the token count, and the optimizer (`wrt=nnx.Param`) gets only
  the parameters' gradients.
  """
  grad_fn = nnx.value_and_grad(
      functools.partial(_loss_sum, train_cfg),
      argnums=nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta)),
      has_aux=True,
  )
  accum = train_cfg.grad_accum_steps
  if accum > 1 and model_cfg.quantization == 'fp8':
    raise NotImplementedError(
        'fp8 with gradient accumulation: the scaling state of each microbatch would be'
        ' summed, not overwritten'
    )

  def microbatch_grads(model, batch, dropout_base, step, microbatch):
    """((grads, loss_sum, z_sum, tokens), next fp8 state) of one microbatch."""
    key = rng.step_key(dropout_base, step, microbatch)
    (loss_sum, (z_sum, tokens)), grads = grad_fn(model, batch, key)
    grads, fp8_meta = nnx.split_state(grads, nnx.Param, Fp8Meta)
    return (grads, loss_sum, z_sum, tokens), fp8_meta

  def train_step(graphdef, state, batch, dropout_base):
    model, optimizer = nnx.merge(graphdef, state)
    step = optimizer.step[...]
    if accum == 1:
      (grads, loss_sum, z_sum, tokens), fp8_meta = microbatch_grads(
          model, batch, dropout_base, step, 0
      )
    else:
      microbatches = jax.tree.map(
          lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch
      )

      # A module cannot cross into the scan's trace: carry it as pure state.
      model_def, model_state = nnx.split(model)
      model_state = nnx.as_pure(model_state)

      def accumulate(carry, inputs):
        microbatch, index = inputs
        out, _ = microbatch_grads(
            nnx.merge(model_def, model_state), microbatch, dropout_base, step, index
        )
        return jax.tree.map(jnp.add, carry, out), None

      zero = jnp.zeros((), jnp.float32)
      init = (jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)), zero, zero, zero)
      (grads, loss_sum, z_sum, tokens), _ = jax.lax.scan(
          accumulate, init, (microbatches, jnp.arange(accum, dtype=jnp.uint32))
      )
      fp8_meta = nnx.state(model, Fp8Meta)  # empty: fp8 is refused with accumulation
    grads = jax.tree.map(lambda g: (g / tokens).astype(g.dtype), grads)
    optimizer.update(model, grads)
    nnx.update(model, fp8_meta)
    metrics = {'loss': loss_sum / tokens, 'z_loss': z_sum / tokens, 'tokens': tokens}
    return nnx.state((model, optimizer)), metrics

  return jax.jit(train_step, static_argnums=0)


@functools.cache
def make_eval_step(model_cfg: ModelConfig, train_cfg: TrainConfig):
  """The jitted `eval_step(graphdef, state, batch) -> {loss, accuracy, tokens}` (dropout off).

  Mean loss (cross-entropy plus z-loss, as trained) and the fraction of real
  tokens whose argmax prediction is the target, both over real tokens, and
  their count. Reads the state, returns nothing of it: no parameter or fp8
  state changes.
  """
  del model_cfg

  def eval_step(graphdef, state, batch):
    model, _ = nnx.merge(graphdef, state)
    model.eval()
    logits_BLV = _forward(model, batch, jnp.zeros((2,), jnp.uint32))
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

  return jax.jit(eval_step, static_argnums=0)


@functools.cache
def make_loss_and_grad(model_cfg: ModelConfig, train_cfg: TrainConfig):
  """The jitted `(graphdef, state, batch, dropout_key) -> ((loss_sum, (z_sum, tokens)), grads)`."""
  del model_cfg
  grad_fn = nnx.value_and_grad(functools.partial(_loss_sum, train_cfg), has_aux=True)

  def loss_and_grad(graphdef, state, batch, dropout_key):
    model, _ = nnx.merge(graphdef, state)
    return grad_fn(model, batch, dropout_key)

  return jax.jit(loss_and_grad, static_argnums=0)
