"""A llama-ish decoder written the way production Linen code is: the fifth family.

Mirrors models/nnx/prod.py class for class: `RMSNorm`, rotary causal
`Attention` and a SwiGLU MLP (the NNX side's own) in pre-norm `Block`s with dropout; the blocks
stacked by `nn.scan` over a rematerialised block (`nn.scan(nn.remat(Block))`
under the config's remat policy, parameters stacked on axis 0 under the
logical name 'layers', the dropout keys split per layer, drawn with
`make_rng`); every parameter named with logical axes
(`nn.with_logical_partitioning`), activations constrained by logical names
(`nn.with_logical_constraint`), all resolved by PROD_RULES. The MLP is
already migrated, as in a half-migrated codebase: the NNX side's own `Mlp`
(models/nnx/prod.py), its dropout inside, behind the project's own copy of a
ToLinen wrapper (models/linen/nnx_wrappers.py), not flax's, which makes its
streams of Linen's `make_rng` key at every apply. Modules are named explicitly, as the NNX attributes are, so both
sides flatten in one order. Trained with the stock `TrainState`: adamw under
a warmup schedule, gradients clipped by their global norm.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import parity
from models.families import PROD_ACTIVATION_AXES, PROD_PARAM_AXES, ProdConfig
from models.linen import nnx_wrappers
from models.nnx import prod as nnx_prod


# How each scanned layer is rematerialised (ProdConfig.remat_policy); 'full' saves nothing.
REMAT_POLICIES = {
    'full': None,
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _init(init, axes: str):
  return nn.with_logical_partitioning(init, PROD_PARAM_AXES[axes])


def constrain(x, axes: str):
  return nn.with_logical_constraint(x, PROD_ACTIVATION_AXES[axes])


def rope(x, max_timescale: float):
  """Rotary position embedding of [B, L, H, D] at positions 0..L-1 (halves rotated)."""
  half = x.shape[-1] // 2
  timescale = max_timescale ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
  angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] / timescale  # [L, D/2]
  sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class RMSNorm(nn.Module):
  epsilon: float

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', _init(nn.initializers.ones, 'norm'), (x.shape[-1],))
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(mean_square + self.epsilon) * scale


class Attention(nn.Module):
  cfg: ProdConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    batch, length, _ = x.shape

    def project(name):
      y = nn.Dense(cfg.num_heads * cfg.head_dim, use_bias=False, name=name,
                   kernel_init=_init(nn.initializers.lecun_normal(), 'qkv'))(x)
      return constrain(y.reshape(batch, length, cfg.num_heads, cfg.head_dim), 'heads')

    q = rope(project('query'), cfg.rope_max_timescale) * cfg.head_dim ** -0.5
    k = rope(project('key'), cfg.rope_max_timescale)
    v = project('value')
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
    y = constrain(jnp.einsum('bhqk,bkhd->bqhd', weights, v), 'heads').reshape(batch, length, -1)
    return nn.Dense(cfg.emb_dim, use_bias=False, name='out',
                    kernel_init=_init(nn.initializers.lecun_normal(), 'out'))(y)


class Block(nn.Module):
  """One pre-norm decoder layer; (x, None) as nn.scan takes a body."""

  cfg: ProdConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    y = Attention(cfg, name='attention')(RMSNorm(cfg.norm_epsilon, name='attention_norm')(x))
    x = x + nn.Dropout(cfg.dropout_rate, name='attention_dropout')(y, deterministic=self.deterministic)
    x = constrain(x, 'hidden')
    y = nnx_wrappers.ToLinen(nnx_prod.Mlp, (cfg,), name='mlp')(RMSNorm(cfg.norm_epsilon, name='mlp_norm')(x),
                                                               deterministic=self.deterministic)
    x = x + nn.Dropout(cfg.dropout_rate, name='mlp_dropout')(y, deterministic=self.deterministic)
    return constrain(x, 'hidden'), None


class Transformer(nn.Module):
  cfg: ProdConfig

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim, name='embed',
                 embedding_init=_init(nn.initializers.normal(1.0), 'embedding'))(tokens)
    x = constrain(x, 'hidden')
    # Under scan, CSE across iterations cannot happen: prevent_cse=False, as production does.
    stack = nn.scan(
        nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat_policy]),
        variable_axes={'params': 0},
        split_rngs={'params': True, 'dropout': True},
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: 'layers'},
    )
    x, _ = stack(cfg, deterministic=not train, name='layers')(x)
    x = RMSNorm(cfg.norm_epsilon, name='final_norm')(x)
    logits = nn.Dense(cfg.vocab_size, use_bias=False, name='head',
                      kernel_init=_init(nn.initializers.lecun_normal(), 'head'))(x)
    return constrain(logits, 'logits')


TrainState = train_state.TrainState


def make_optimizer(cfg: ProdConfig) -> optax.GradientTransformation:
  schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


def create_train_state(cfg: ProdConfig, seed: int) -> TrainState:
  model = Transformer(cfg)
  tokens = jnp.ones((1, cfg.seq_len - 1), jnp.int32)
  variables = model.init(jax.random.PRNGKey(seed), tokens)
  return TrainState.create(apply_fn=model.apply, params=variables['params'], tx=make_optimizer(cfg))


def next_token_loss(logits, tokens):
  """Mean cross entropy of each position's logits against the next token."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def loss_fn(params, state: TrainState, batch, dropout_key):
  tokens = batch['tokens']
  logits = state.apply_fn({'params': params}, tokens[:, :-1], train=True, rngs={'dropout': dropout_key})
  return next_token_loss(logits, tokens)


@jax.jit
def train_step(state: TrainState, batch, dropout_base):
  key = parity.step_key(dropout_base, state.step, 0)
  loss, grads = jax.value_and_grad(loss_fn)(state.params, state, batch, key)
  return state.apply_gradients(grads=grads), {'loss': loss, 'grad_norm': optax.tree.norm(grads)}


def forward(state: TrainState, batch):
  """The model's eval-mode output (the logits), as the kit's eval part compares it."""
  return state.apply_fn({'params': state.params}, batch['tokens'][:, :-1])


@jax.jit
def eval_step(state: TrainState, batch):
  return {'loss': next_token_loss(forward(state, batch), batch['tokens'])}


# --- checkpoints, as this codebase's training writes and reads them ---
#
# The TrainState as it is, one CheckpointManager item, ITEM (models/nnx/prod.py writes the same tree).

ITEM = 'items'


def save_checkpoint(manager, step: int, state: TrainState) -> None:
  """Saves step `step` with an Orbax CheckpointManager, as the training loop does."""
  import orbax.checkpoint as ocp

  manager.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardSave(state)}))
  manager.wait_until_finished()


def restore_checkpoint(manager, step: int, state: TrainState) -> TrainState:
  """Step `step`, restored in `state`'s shapes and shardings, as the training loop resumes."""
  import orbax.checkpoint as ocp

  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  return manager.restore(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(abstract)}))[ITEM]
