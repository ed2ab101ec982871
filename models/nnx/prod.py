"""A llama-ish decoder written the way production NNX code is: the fifth family.

Mirrors models/linen/prod.py class for class: `RMSNorm`, rotary causal
`Attention` and a SwiGLU `Mlp` in pre-norm `Block`s with dropout. The blocks
are made stacked by `nnx.vmap` over split `nnx.Rngs` (parameters stacked on
axis 0 under the logical name 'layers') and run by `jax.lax.scan` over the
state `nnx.split` gives, each layer under `jax.checkpoint` (the config's remat
policy). Its RNG streams come from one key by the codebase's own helper
(`make_rngs`: parameters, dropout and a stream the model never draws, each a
fold-in), and each dropout, the codebase's own subclass (`Dropout`), holds a
fork of that whole `nnx.Rngs`, every stream, as production NNX code keeps it.
So the model keeps RNG state, stacked per layer, that a Linen `TrainState`
does not have; when
a dropout draws (train mode, a rate above 0), the scan hands back the streams
it advanced. Parameters carry logical axes
(`nnx.with_partitioning`), activations logical constraints
(`nn.with_logical_constraint`: flax has no NNX one), all resolved by
PROD_RULES. Trained with the stock `nnx.Optimizer`, as the Linen side.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.families import PROD_ACTIVATION_AXES, PROD_PARAM_AXES, ProdConfig


# How each scanned layer is rematerialised (ProdConfig.remat_policy); 'full' saves nothing.
REMAT_POLICIES = {
    'full': None,
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _init(init, axes: str):
  # Placed once, whole, by the trainer (not eagerly, variable by variable, at creation).
  return nnx.with_partitioning(init, PROD_PARAM_AXES[axes], eager_sharding=False)


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


def _dense(in_features: int, out_features: int, axes: str, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs,
                    kernel_init=_init(nnx.initializers.lecun_normal(), axes))


class RMSNorm(nnx.Module):

  def __init__(self, features: int, epsilon: float, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(_init(nnx.initializers.ones, 'norm')(rngs.params(), (features,)))
    self.epsilon = epsilon

  def __call__(self, x):
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(mean_square + self.epsilon) * self.scale[...]


class Attention(nnx.Module):

  def __init__(self, cfg: ProdConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    width = cfg.num_heads * cfg.head_dim
    self.key = _dense(cfg.emb_dim, width, 'qkv', rngs)
    self.out = _dense(width, cfg.emb_dim, 'out', rngs)
    self.query = _dense(cfg.emb_dim, width, 'qkv', rngs)
    self.value = _dense(cfg.emb_dim, width, 'qkv', rngs)

  def __call__(self, x):
    cfg = self.cfg
    batch, length, _ = x.shape

    def project(dense):
      return constrain(dense(x).reshape(batch, length, cfg.num_heads, cfg.head_dim), 'heads')

    q = rope(project(self.query), cfg.rope_max_timescale) * cfg.head_dim ** -0.5
    k = rope(project(self.key), cfg.rope_max_timescale)
    v = project(self.value)
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
    y = constrain(jnp.einsum('bhqk,bkhd->bqhd', weights, v), 'heads').reshape(batch, length, -1)
    return self.out(y)


class Dropout(nnx.Dropout):
  """The codebase's own dropout: it keeps a fork of the whole `nnx.Rngs` it is given (every
  stream), where flax's keeps a fork of the one stream it draws, and draws as flax's does
  (`rngs[rng_collection]`)."""

  def __init__(self, rate: float, *, rngs: nnx.Rngs, rng_collection: str = 'dropout'):
    super().__init__(rate, rng_collection=rng_collection)
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f'Dropout: rngs must be an nnx.Rngs, got {type(rngs).__name__}')
    self.rngs = rngs.fork()


class Mlp(nnx.Module):
  """The SwiGLU MLP, dropout on its hidden activations. The Linen side runs this very class behind
  the project's own ToLinen copy (models/linen/nnx_wrappers.py), as a half-migrated codebase does:
  there its dropout draws from streams the wrapper makes of Linen's key."""

  def __init__(self, cfg: ProdConfig, *, rngs: nnx.Rngs):
    self.wi_0 = _dense(cfg.emb_dim, cfg.mlp_dim, 'mlp_in', rngs)
    self.wi_1 = _dense(cfg.emb_dim, cfg.mlp_dim, 'mlp_in', rngs)
    self.dropout = Dropout(cfg.dropout_rate, rngs=rngs)
    self.wo = _dense(cfg.mlp_dim, cfg.emb_dim, 'mlp_out', rngs)

  def __call__(self, x, deterministic: bool = True):
    hidden = constrain(nnx.silu(self.wi_0(x)) * self.wi_1(x), 'mlp')
    return self.wo(self.dropout(hidden, deterministic=deterministic))


class Block(nnx.Module):
  """One pre-norm decoder layer; its dropouts hold forked streams of `rngs`."""

  def __init__(self, cfg: ProdConfig, *, rngs: nnx.Rngs):
    self.attention = Attention(cfg, rngs=rngs)
    self.attention_dropout = Dropout(cfg.dropout_rate, rngs=rngs)
    self.attention_norm = RMSNorm(cfg.emb_dim, cfg.norm_epsilon, rngs=rngs)
    self.mlp = Mlp(cfg, rngs=rngs)
    self.mlp_dropout = Dropout(cfg.dropout_rate, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.emb_dim, cfg.norm_epsilon, rngs=rngs)

  def __call__(self, x, deterministic: bool = True):
    y = self.attention(self.attention_norm(x))
    x = constrain(x + self.attention_dropout(y, deterministic=deterministic), 'hidden')
    y = self.mlp(self.mlp_norm(x), deterministic=deterministic)
    return constrain(x + self.mlp_dropout(y, deterministic=deterministic), 'hidden')


class Transformer(nnx.Module):

  def __init__(self, cfg: ProdConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.emb_dim, rngs=rngs,
                           embedding_init=_init(nnx.initializers.normal(1.0), 'embedding'))
    self.final_norm = RMSNorm(cfg.emb_dim, cfg.norm_epsilon, rngs=rngs)
    self.head = _dense(cfg.emb_dim, cfg.vocab_size, 'head', rngs)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def stacked(rngs: nnx.Rngs) -> Block:
      return Block(cfg, rngs=rngs)

    self.layers = stacked(rngs)
    self.dropout_rate = cfg.dropout_rate
    self.remat_policy = cfg.remat_policy

  def streams_advance(self, train: bool) -> bool:
    """Whether a forward pass draws from the dropouts' streams (train mode, a rate above 0)."""
    return train and self.dropout_rate > 0

  def __call__(self, tokens, train: bool = False):
    x = constrain(self.embed(tokens), 'hidden')
    graphdef, state = nnx.split(self.layers)
    advance = self.streams_advance(train)

    # The layer's state enters the checkpoint as an input only, as in Linen's nn.remat
    # (nnx.remat over the module would also return it). Under scan, CSE across iterations
    # cannot happen: prevent_cse=False, as the Linen side.
    @functools.partial(jax.checkpoint, prevent_cse=False, policy=REMAT_POLICIES[self.remat_policy])
    def layer(state, x):
      block = nnx.merge(graphdef, state)
      y = block(x, deterministic=not train)
      # The streams a dropout drew from come back (next step, new masks). Nothing drawn, they
      # stay out of the loop, whose tuple would otherwise hold them in and out (Linen's nn.scan
      # splits its dropout keys inside the step: nothing of them is state).
      return y, (nnx.state(block, nnx.RngState) if advance else None)

    def body(x, state):
      return layer(state, x)

    x, streams = jax.lax.scan(body, x, state)
    if advance:
      nnx.update(self.layers, streams)
    return constrain(self.head(self.final_norm(x)), 'logits')


def make_optimizer(cfg: ProdConfig) -> optax.GradientTransformation:
  schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


def make_rngs(seed: int) -> nnx.Rngs:
  """The model's streams, each its own fold-in of one key: parameters, dropout, and 'noise', which
  this model never draws (codebases keep streams for features a configuration leaves off)."""
  key = jax.random.PRNGKey(seed)
  return nnx.Rngs(params=jax.random.fold_in(key, 0), dropout=jax.random.fold_in(key, 1),
                  noise=jax.random.fold_in(key, 2))


def create_train_state(cfg: ProdConfig, seed: int) -> tuple[Transformer, nnx.Optimizer]:
  model = Transformer(cfg, rngs=make_rngs(seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)


def next_token_loss(logits, tokens):
  """Mean cross entropy of each position's logits against the next token."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def loss_fn(model: Transformer, batch, dropout_key=None):
  """Next-token cross entropy in train mode; dropout draws from the model's own streams
  (`dropout_key`, the kit's step key, is not used)."""
  tokens = batch['tokens']
  return next_token_loss(model(tokens[:, :-1], train=True), tokens)


@nnx.jit
def train_step(model: Transformer, optimizer: nnx.Optimizer, batch, dropout_base):
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return {'loss': loss, 'grad_norm': optax.tree.norm(grads)}


def forward(model: Transformer, batch):
  """The model's eval-mode output (the logits), as the kit's eval part compares it."""
  return model(batch['tokens'][:, :-1])


@nnx.jit
def eval_step(model: Transformer, batch):
  return {'loss': next_token_loss(forward(model, batch), batch['tokens'])}


# --- checkpoints, as this codebase's training writes and reads them ---
#
# The NNX training saves in the Linen TrainState's on-disk tree, so that runs of either side resume
# from the other's checkpoints, and keeps what Linen has no place for (the RNG streams the model
# holds) beside it, under `nnx_aux`. One CheckpointManager item, ITEM, as the Linen side writes.

ITEM = 'items'


def checkpoint_tree(train_state: tuple[Transformer, nnx.Optimizer]) -> dict:
  """The tree this codebase saves: Linen's `step` (int32), `params` and `opt_state` (optax's own
  tuple of states), plus `nnx_aux`, the model's RNG streams."""
  model, optimizer = train_state
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  own = nnx.to_pure_dict(nnx.state(optimizer))
  chain = jax.tree.structure(jax.eval_shape(optimizer.tx.init, params))
  return {
      'step': own['step'].astype(jnp.int32),
      'params': params,
      'opt_state': jax.tree.unflatten(chain, jax.tree.leaves(own['opt_state'])),
      'nnx_aux': nnx.to_pure_dict(nnx.state(model, nnx.RngState)),
  }


def restore_checkpoint_tree(tree: dict, train_state: tuple[Transformer, nnx.Optimizer]) -> None:
  """Writes a restored `checkpoint_tree` into the train state, in place: its inverse."""
  model, optimizer = train_state
  for kind, saved in ((nnx.Param, tree['params']), (nnx.RngState, tree['nnx_aux'])):
    state = nnx.state(model, kind)
    nnx.replace_by_pure_dict(state, saved)
    nnx.update(model, state)
  state = nnx.state(optimizer)
  own = nnx.to_pure_dict(state)
  own['step'] = jnp.asarray(tree['step']).astype(own['step'].dtype)
  own['opt_state'] = jax.tree.unflatten(jax.tree.structure(own['opt_state']), jax.tree.leaves(tree['opt_state']))
  nnx.replace_by_pure_dict(state, own)
  nnx.update(optimizer, state)


def save_checkpoint(manager, step: int, train_state) -> None:
  """Saves step `step` with an Orbax CheckpointManager, as the training loop does."""
  import orbax.checkpoint as ocp

  manager.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardSave(checkpoint_tree(train_state))}))
  manager.wait_until_finished()


def restore_checkpoint(manager, step: int, train_state) -> None:
  """Restores step `step` into the train state (in place), as the training loop resumes."""
  import orbax.checkpoint as ocp

  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, checkpoint_tree(train_state))
  restored = manager.restore(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(abstract)}))
  restore_checkpoint_tree(restored[ITEM], train_state)
