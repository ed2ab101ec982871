"""Configs and synthetic data of the stock-layer model families.

The reference decoder (models/config.py, models/data.py) is written layer by
layer; these two are built from flax's stock layers on both sides, as a
user's own migration would be, and are tested through the pytest plugin
only (parity/battery/plugin.py). Framework-free, like models/config.py: both sides
read the same dataclasses and batches.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
  """A small convolutional classifier: conv, batch norm, relu, pool, twice; dropout; dense."""

  image_size: int = 8
  in_channels: int = 3
  channels: tuple[int, int] = (8, 16)
  num_classes: int = 10
  dropout_rate: float = 0.1
  batch_norm_momentum: float = 0.9
  batch_norm: bool = True  # False: conv, relu, pool (isolates batch norm's program)
  batch_size: int = 8
  learning_rate: float = 1e-2
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
  """A post-embedding transformer encoder: stock attention, layer norm and embedding."""

  vocab_size: int = 64
  emb_dim: int = 32
  num_heads: int = 4
  mlp_dim: int = 64
  num_layers: int = 2
  num_classes: int = 4
  seq_len: int = 8
  batch_size: int = 8
  learning_rate: float = 1e-3
  seed: int = 0
  # NNX attention: 'stock' (nnx.MultiHeadAttention's default, jax.nn.dot_product_attention:
  # logits scaled after q.k) or 'linen' (flax.linen's formula: the query scaled
  # before q.k), which keeps the Linen model's numbers bit for bit.
  nnx_attention: str = 'linen'


# The encoder's parameters carry logical axis names (Linen
# `nn.with_logical_partitioning`, NNX `out_sharding` metadata), resolved on a
# mesh by ENCODER_RULES: attention heads, the MLP's hidden units and the
# vocabulary over `tensor`, the batch over `data`.
# The attention projections are named by their leading axes only. Linen's
# stock DenseGeneral initialises a kernel (bias) flattened to 2-D (1-D) and
# reshapes it after, keeping the box's names; under a mesh it applies them to
# the flat value first, so names for the full rank fail there (flax issue
# #3892). Names of the leading axes hold for both shapes; NNX takes the same.
ENCODER_AXES: dict[str, tuple[str | None, ...]] = {
    'embedding': ('vocab', 'embed'),
    'norm': ('embed',),
    'qkv_kernel': ('embed', 'heads'),  # [embed, heads, head_dim]; 2-D init [embed, heads * head_dim]
    'qkv_bias': ('heads',),  # [heads, head_dim]
    'out_kernel': ('heads',),  # [heads, head_dim, embed]; 2-D init [heads * head_dim, embed]
    'out_bias': ('embed',),
    'mlp_in_kernel': ('embed', 'mlp'),
    'mlp_in_bias': ('mlp',),
    'mlp_out_kernel': ('mlp', 'embed'),
    'mlp_out_bias': ('embed',),
    'head_kernel': ('embed', 'classes'),
    'head_bias': ('classes',),
}
# Activations carry logical names too, at the layer boundaries and on the
# MLP's hidden units: `nn.with_logical_constraint` on both sides (flax.linen's
# function reads the rules from `nn.logical_axis_rules` and applies jax's
# sharding constraint; flax's NNX has no logical activation constraint of its
# own). A no-op off a mesh.
ENCODER_ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    'hidden': ('batch', 'length', 'embed'),  # the embedding's output and each layer's
    'mlp': ('batch', 'length', 'mlp'),  # the MLP's hidden units, after the activation
}
ENCODER_RULES: tuple[tuple[str, str | None], ...] = (
    ('batch', 'data'), ('vocab', 'tensor'), ('heads', 'tensor'), ('mlp', 'tensor'),
    ('embed', None), ('classes', None), ('length', None),
)


def classifier_batch(cfg: ClassifierConfig, step: int, split: str = 'train') -> dict[str, np.ndarray]:
  """{images: float32 [B, H, W, C], labels: int32 [B]}, a pure function of (seed, split, step)."""
  rng = np.random.default_rng([cfg.seed, {'train': 0, 'eval': 1}[split], step])
  shape = (cfg.batch_size, cfg.image_size, cfg.image_size, cfg.in_channels)
  return {
      'images': rng.standard_normal(shape, dtype=np.float32),
      'labels': rng.integers(0, cfg.num_classes, cfg.batch_size).astype(np.int32),
  }


def encoder_batch(cfg: EncoderConfig, step: int, split: str = 'train') -> dict[str, np.ndarray]:
  """{tokens: int32 [B, L], labels: int32 [B]}, a pure function of (seed, split, step)."""
  rng = np.random.default_rng([cfg.seed, {'train': 0, 'eval': 1}[split], step])
  return {
      'tokens': rng.integers(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len)).astype(np.int32),
      'labels': rng.integers(0, cfg.num_classes, cfg.batch_size).astype(np.int32),
  }


@dataclasses.dataclass(frozen=True)
class LmConfig:
  """A small causal language model: embedding, pre-norm decoder blocks (stock attention, MLP), dense head.

  head_dim = emb_dim // num_heads (16): Linen's attention divides the query by
  sqrt(head_dim), NNX's stock one (jax.nn.dot_product_attention) multiplies the
  logits by 1/sqrt(head_dim) and lays its sums out otherwise, which can round
  otherwise at any head_dim (docs/howto-differences.md, "Stock attention").
  """

  vocab_size: int = 64
  emb_dim: int = 32
  num_heads: int = 2
  mlp_dim: int = 64
  num_layers: int = 2
  seq_len: int = 8
  batch_size: int = 8
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0  # the stock attention's own dropout (of its weights)
  learning_rate: float = 1e-2
  seed: int = 0
  # The NNX attention's formula: 'stock' (nnx.MultiHeadAttention's default, which sums
  # otherwise than Linen's: another layout of the same products) or 'linen' (flax.linen's,
  # given as `attention_fn`: the same numbers as the Linen side).
  nnx_attention: str = 'stock'


# Tensor parallelism for the language model: vocabulary, MLP units and heads
# over `tensor`, the batch over `data`. The Linen side annotates its
# parameters with the logical names (resolved by LM_RULES); the NNX side, as
# its users often do, with the mesh axes already resolved (lm_axis_rules).
# Attention kernels are named by their leading axes only (see ENCODER_AXES:
# Linen initialises them flattened): qkv ('embed', 'heads'), out ('heads',).
LM_RULES: tuple[tuple[str, str | None], ...] = (
    ('batch', 'data'), ('vocab', 'tensor'), ('embed', None), ('mlp', 'tensor'), ('heads', 'tensor'),
)
LM_MESH_AXES: dict[str, str | None] = {'vocab': 'tensor', 'embed': None, 'mlp': 'tensor', 'heads': 'tensor'}


def lm_axis_rules(*logical: str) -> tuple[str | None, ...]:
  """The mesh axes of a parameter with these logical axes (LM_MESH_AXES): the NNX side's annotations."""
  return tuple(LM_MESH_AXES[name] for name in logical)


def lm_batch(cfg: LmConfig, step: int, split: str = 'train') -> dict[str, np.ndarray]:
  """{tokens: int32 [B, L]}, a pure function of (seed, split, step).

  Each row counts from a random start by a random stride (mod vocab_size), so
  the next token is predictable from the two before it.
  """
  rng = np.random.default_rng([cfg.seed, {'train': 0, 'eval': 1}[split], step])
  start = rng.integers(0, cfg.vocab_size, (cfg.batch_size, 1))
  stride = rng.integers(1, 4, (cfg.batch_size, 1))
  return {'tokens': ((start + stride * np.arange(cfg.seq_len)) % cfg.vocab_size).astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class ProdConfig:
  """A llama-ish decoder as production code writes it: RMSNorm, rotary attention, SwiGLU MLP,
  dropout; the layers stacked and scanned, each rematerialised; logical axis names throughout.

  Dropout on: the NNX dropouts draw from streams the model keeps, the Linen ones from
  `make_rng`; the pair gives the NNX side Linen's keys (`StockNnx(dropout_keys='linen')`).
  `remat_policy`: how each scanned layer is rematerialised, 'full' or 'save_dots'.
  """

  vocab_size: int = 64
  emb_dim: int = 32
  num_heads: int = 4
  head_dim: int = 8
  mlp_dim: int = 64
  num_layers: int = 3
  seq_len: int = 8
  batch_size: int = 8
  dropout_rate: float = 0.1
  norm_epsilon: float = 1e-6
  rope_max_timescale: float = 10_000.0
  learning_rate: float = 1e-2
  warmup_steps: int = 2
  seed: int = 0
  remat_policy: str = 'full'


# The production mesh: five axes, in this order (pipeline stages and sequence parallelism
# included, each of size 1 where unused).
PROD_MESH_AXES = ('data', 'stage', 'fsdp', 'sequence', 'tensor')

# Logical axis names of the parameters (both sides annotate with these) ...
PROD_PARAM_AXES: dict[str, tuple[str, ...]] = {
    'embedding': ('vocab', 'embed'),
    'norm': ('norm',),
    'qkv': ('embed', 'heads'),  # [embed, heads * head_dim]
    'out': ('heads', 'embed'),
    'mlp_in': ('embed', 'mlp'),
    'mlp_out': ('mlp', 'embed'),
    'head': ('embed', 'vocab'),
}
# ... and of the activations they constrain (nn.with_logical_constraint on both sides).
PROD_ACTIVATION_AXES: dict[str, tuple[str, ...]] = {
    'hidden': ('activation_batch', 'activation_length', 'activation_embed'),
    'heads': ('activation_batch', 'activation_length', 'activation_heads', 'activation_kv'),
    'mlp': ('activation_batch', 'activation_length', 'activation_mlp'),
    'logits': ('activation_embed_and_logits_batch', 'activation_length', 'activation_vocab'),
}
# The rules of a production config: the model's own names and the many more such a config
# carries for its other models (MoE, MLA, KV caches, paged attention, pipelining). flax
# resolves them in priority order, each mesh axis at most once per array.
PROD_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ('activation_batch', ('data', 'fsdp')),
    ('activation_batch_no_exp', ('data', 'fsdp')),
    ('activation_embed_and_logits_batch', ('data', 'fsdp')),
    ('activation_embed_and_logits_batch_sequence', ('data', 'fsdp', 'sequence')),
    ('activation_prefill_kv_batch', ('data', 'fsdp')),
    ('activation_kv_batch', ('data', 'fsdp')),
    ('activation_heads', 'tensor'),
    ('activation_kv_heads', 'tensor'),
    ('activation_q_heads', 'tensor'),
    ('activation_length', 'sequence'),
    ('activation_length_no_exp', 'sequence'),
    ('activation_norm_length', 'sequence'),
    ('activation_q_length', 'sequence'),
    ('activation_kv_length', None),
    ('activation_attn_length', 'sequence'),
    ('activation_attn_embed', 'tensor'),
    ('activation_embed', 'tensor'),
    ('activation_embed_moe', 'tensor'),
    ('activation_mlp', 'tensor'),
    ('activation_mlp_moe', 'tensor'),
    ('activation_kv', None),
    ('activation_kv_head_dim', None),
    ('activation_vocab', 'tensor'),
    ('activation_stage', 'stage'),
    ('activation_exp', None),
    ('activation_norm', None),
    ('activation_lora', None),
    ('activation_group', None),
    ('decode_batch', ('data', 'fsdp')),
    ('decode_length', None),
    ('prefill_activation_length', 'sequence'),
    ('prefill_activation_norm_length', 'sequence'),
    # parameters
    ('layers', 'stage'),
    ('dense_layers', 'stage'),
    ('moe_layers', 'stage'),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('embed_no_exp', 'fsdp'),
    ('embed_tensor_transpose', 'tensor'),
    ('heads', 'tensor'),
    ('q_heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('kv', None),
    ('kv_head_dim', None),
    ('qkv', None),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('mlp_no_fsdp', 'tensor'),
    ('norm', None),
    ('scale', None),
    ('bias', None),
    ('exp', None),
    ('expert', None),
    ('moe_mlp', 'tensor'),
    ('q_lora', 'fsdp'),
    ('kv_lora', 'fsdp'),
    ('q_lora_up_proj', None),
    ('kv_lora_up_proj', None),
    ('rope_dim', None),
    ('position', None),
    ('relative_position', None),
    ('classes', None),
    # KV caches and paged attention
    ('cache_batch', ('data', 'fsdp')),
    ('cache_batch_prefill', ('data', 'fsdp')),
    ('cache_heads', 'tensor'),
    ('cache_heads_none', None),
    ('cache_kv', None),
    ('cache_sequence', None),
    ('cache_scale_batch', ('data', 'fsdp')),
    ('cache_scale_heads', 'tensor'),
    ('cache_scale_kv', None),
    ('cache_scale_sequence', None),
    ('num_pages', None),
    ('tokens_per_page', None),
    ('paged_kv_head_dim_size', None),
)


def prod_mesh(spec: str, devices):
  """The production mesh of a spec such as 'data=2,stage=1,fsdp=2,sequence=1,tensor=2' over
  `devices`: axes PROD_MESH_AXES in that order (an axis not given has size 1)."""
  from parity.core import compat, specs  # jax only where a mesh is made

  sizes = specs.parse_mesh_spec(spec, len(devices))
  unknown = sorted(set(sizes) - set(PROD_MESH_AXES))
  if unknown:
    raise ValueError(f'mesh spec {spec!r}: axes {unknown} are not the production mesh\'s {PROD_MESH_AXES}')
  return compat.make_mesh(tuple(sizes.get(a, 1) for a in PROD_MESH_AXES), PROD_MESH_AXES, devices)


def prod_batch(cfg: ProdConfig, step: int, split: str = 'train') -> dict[str, np.ndarray]:
  """{tokens: int32 [B, L]}, a pure function of (seed, split, step): rows counting by a stride
  (mod vocab_size), as lm_batch."""
  return lm_batch(LmConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                           seed=cfg.seed), step, split)


@dataclasses.dataclass(frozen=True)
class RnnConfig:
  """A small recurrent language model: embedding, an LSTM over the sequence (flax's stock RNN),
  dropout, dense head; next-token cross entropy on lm_batch's counting rows."""

  vocab_size: int = 32
  emb_dim: int = 16
  hidden: int = 32
  seq_len: int = 9  # 8 inputs, each position's next token its target
  batch_size: int = 8
  dropout_rate: float = 0.1
  # Dropout of the hidden state entering each step, a mask of its own per step (flax has no stock
  # recurrent dropout: the cells are models/*/rnn.py's own); 0 runs flax's stock LSTM cell alone.
  recurrent_dropout_rate: float = 0.0
  # True: one recurrent-dropout mask for every step of a sequence (variational dropout: Linen's
  # `nn.RNN(..., split_rngs={'params': False, 'dropout': False})`, NNX's
  # `nnx.RNN(..., broadcast_rngs='dropout')`); False: a mask per step.
  recurrent_dropout_per_sequence: bool = False
  learning_rate: float = 3e-3
  seed: int = 0


def rnn_batch(cfg: RnnConfig, step: int, split: str = 'train') -> dict[str, np.ndarray]:
  """{tokens: int32 [B, L]}, a pure function of (seed, split, step): lm_batch's rows."""
  return lm_batch(LmConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                           seed=cfg.seed), step, split)
