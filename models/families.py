"""Configs and synthetic data of the two stock-layer model families.

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

  head_dim = emb_dim // num_heads must be a power of 4: Linen's attention divides
  the query by sqrt(head_dim), NNX's stock one (jax.nn.dot_product_attention)
  multiplies the logits by 1/sqrt(head_dim); both are exact only then.
  """

  vocab_size: int = 64
  emb_dim: int = 32
  num_heads: int = 2
  mlp_dim: int = 64
  num_layers: int = 2
  seq_len: int = 8
  batch_size: int = 8
  dropout_rate: float = 0.1
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
