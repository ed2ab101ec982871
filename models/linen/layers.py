"""Linen building blocks: dense (optionally fp8), embedding, RMSNorm, RoPE, dropout, attention, MLP.

Mirrors models/nnx/layers.py class for class. Parameters carry logical axes
through `nn.with_logical_partitioning`; activations through
`nn.with_logical_constraint` (a no-op outside a mesh). Attention's decode
mode keeps a KV cache in the 'cache' collection (models/linen/decode.py).
"""
from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from models.config import ModelConfig

Axes = tuple[str | None, ...]

# Large negative but finite, so fully masked rows (padding) give no NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Logical axes of a cached key or value, [batch, max length, kv heads, head dim].
CACHE_AXES = ('cache_batch', 'cache_length', 'cache_kv_heads', 'cache_kv_head_dim')


def kernel_init(in_axis, out_axis) -> nn.initializers.Initializer:
  return nn.initializers.variance_scaling(
      1.0, 'fan_in', 'truncated_normal', in_axis=in_axis, out_axis=out_axis
  )


class DenseGeneral(nn.Module):
  """y = x . kernel over the trailing `len(in_features)` axes of x."""

  in_features: tuple[int, ...]
  out_features: tuple[int, ...]
  logical_axes: Axes
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    n_in, n_out = len(self.in_features), len(self.out_features)
    init = kernel_init(tuple(range(n_in)), tuple(range(n_in, n_in + n_out)))
    kernel = self.param(
        'kernel',
        nn.with_logical_partitioning(init, self.logical_axes),
        self.in_features + self.out_features,
        jnp.dtype(self.config.weight_dtype),
    )
    dtype = jnp.dtype(self.config.activation_dtype)
    contract_x = tuple(range(x.ndim - n_in, x.ndim))
    dot_general = jax.lax.dot_general
    if self.config.quantization == 'fp8':
      # flax's op keeps its scales and amax histories in the
      # `_overwrite_with_gradient` collection (see train.TrainState.fp8_meta).
      dot_general = fp8_ops.Fp8DirectDotGeneralOp(
          amax_history_length=self.config.fp8_amax_history_length, name='dot_general'
      )
    return dot_general(
        x.astype(dtype),
        kernel.astype(dtype),
        ((contract_x, tuple(range(n_in))), ((), ())),
    )


class Embed(nn.Module):
  """Token embedding table; `attend` computes logits through it (tied)."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedding = self.param(
        'embedding',
        nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ('vocab', 'embed_vocab')
        ),
        (cfg.vocab_size, cfg.emb_dim),
        jnp.dtype(cfg.weight_dtype),
    )

  def __call__(self, inputs_BL: jax.Array) -> jax.Array:
    dtype = jnp.dtype(self.config.activation_dtype)
    return jnp.take(self.embedding, inputs_BL, axis=0).astype(dtype)

  def attend(self, x_BLE: jax.Array) -> jax.Array:
    dtype = jnp.dtype(self.config.activation_dtype)
    return jnp.einsum('ble,ve->blv', x_BLE.astype(dtype), self.embedding.astype(dtype))


class RMSNorm(nn.Module):
  """Root-mean-square norm, statistics in float32."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    scale = self.param(
        'scale',
        nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
        (x.shape[-1],),
        jnp.dtype(cfg.weight_dtype),
    )
    dtype = jnp.dtype(cfg.activation_dtype)
    x32 = x.astype(jnp.float32)
    mean_sq = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = (x32 * jax.lax.rsqrt(mean_sq + cfg.norm_epsilon)).astype(dtype)
    return y * scale.astype(dtype)


def apply_rope(x_BLHD: jax.Array, positions_BL: jax.Array, config: ModelConfig) -> jax.Array:
  """Rotary position embedding (rotate-half form), computed in float32."""
  head_dim = x_BLHD.shape[-1]
  fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  timescale = config.rope_min_timescale * (
      config.rope_max_timescale / config.rope_min_timescale
  ) ** fraction
  angle = positions_BL[:, :, None, None].astype(jnp.float32) / timescale
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = jnp.split(x_BLHD.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate(
      [first * cos - second * sin, second * cos + first * sin], axis=-1
  )
  return rotated.astype(x_BLHD.dtype)


class Dropout(nn.Module):
  """Inverted dropout with an explicit key (never `make_rng`)."""

  rate: float
  deterministic: bool = False

  def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
    if self.rate == 0.0 or self.deterministic:
      return x
    keep = jax.random.bernoulli(key, 1.0 - self.rate, x.shape)
    return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros_like(x))


def cache_positions(index: jax.Array, batch: int, length: int) -> jax.Array:
  """int32[batch, length]: positions of `length` new tokens written at cache slot `index` on."""
  return jnp.broadcast_to(index + jnp.arange(length, dtype=jnp.int32), (batch, length))


def cache_mask(positions_BL: jax.Array, cache_length: int) -> jax.Array:
  """bool[B, L, S]: each token sees the cache slots up to its own position.

  Causal within the new tokens, and the slots after them (not written yet:
  zeros) are masked out.
  """
  return jnp.arange(cache_length, dtype=jnp.int32)[None, None, :] <= positions_BL[:, :, None]


class Attention(nn.Module):
  """Causal, segment-masked grouped-query attention with RoPE.

  With `decode=True`, an `init` creates the cache at its input's length (the
  most tokens it will hold); each `apply(..., mutable=['cache'])` then
  writes its tokens' keys and values at `cache_index` and attends to the
  cache. Decoding reads positions from `cache_index` (not `positions_BL`)
  and assumes one segment per row (`segment_ids_BL` is not read).
  """

  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLE, positions_BL, segment_ids_BL):
    cfg = self.config
    e, n, k, d = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x_BLE = nn.with_logical_constraint(
        x_BLE, ('activation_batch', 'activation_attn_length', 'activation_attn_embed')
    )
    q_BLND = DenseGeneral((e,), (n, d), ('embed', 'q_heads', 'kv'), cfg, name='query')(x_BLE)
    k_BLKD = DenseGeneral((e,), (k, d), ('embed', 'kv_heads', 'kv_head_dim'), cfg, name='key')(x_BLE)
    v_BLKD = DenseGeneral((e,), (k, d), ('embed', 'kv_heads', 'kv_head_dim'), cfg, name='value')(x_BLE)
    b, length = x_BLE.shape[:2]
    cache = self._cache(k_BLKD) if self.decode else None
    if cache is not None:
      positions_BL = cache_positions(cache[2].value, b, length)
    qkv_axes = (
        'activation_kv_batch', 'activation_attn_length',
        'activation_kv_heads', 'activation_kv_head_dim',
    )
    q_BLND = nn.with_logical_constraint(apply_rope(q_BLND, positions_BL, cfg), qkv_axes)
    k_BLKD = nn.with_logical_constraint(apply_rope(k_BLKD, positions_BL, cfg), qkv_axes)
    v_BLKD = nn.with_logical_constraint(v_BLKD, qkv_axes)

    # Two branches around the first einsum, so that training traces its ops in the order it
    # always has (the mask after the einsum): the same program as before decoding existed.
    if cache is None:
      k_BSKD, v_BSKD = k_BLKD, v_BLKD
    else:
      k_BSKD, v_BSKD = self._write_cache(cache, k_BLKD, v_BLKD)
    q_BLKGD = (q_BLND * d**-0.5).reshape(b, length, k, n // k, d)
    logits_BKGLS = jnp.einsum(
        'blkgd,bskd->bkgls', q_BLKGD, k_BSKD, preferred_element_type=jnp.float32
    )
    if cache is None:
      causal_LS = jnp.tril(jnp.ones((length, length), jnp.bool_))
      same_segment_BLS = segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :]
      mask_BLS = causal_LS[None] & same_segment_BLS
    else:
      mask_BLS = cache_mask(positions_BL, k_BSKD.shape[1])
    logits_BKGLS = jnp.where(mask_BLS[:, None, None], logits_BKGLS, MASK_VALUE)
    probs_BKGLS = jax.nn.softmax(logits_BKGLS, axis=-1).astype(q_BLND.dtype)
    out_BLKGD = jnp.einsum('bkgls,bskd->blkgd', probs_BKGLS, v_BSKD)
    out_BLND = nn.with_logical_constraint(
        out_BLKGD.reshape(b, length, n, d),
        ('activation_batch', 'activation_attn_length', 'activation_heads', 'activation_kv'),
    )
    return DenseGeneral((n, d), (e,), ('heads', 'kv', 'embed'), cfg, name='out')(out_BLND)

  def _cache(self, k_BLKD):
    """(cached_key, cached_value, cache_index) variables, or None while `init` creates them.

    Created at the input's shape, so the `init` gives the cache its length.
    The index is a scalar, replicated: no logical axes (as on the NNX side).
    """
    initialized = self.has_variable('cache', 'cached_key')
    init = nn.with_logical_partitioning(jnp.zeros, CACHE_AXES)
    cached_key = self.variable('cache', 'cached_key', init, k_BLKD.shape, k_BLKD.dtype)
    cached_value = self.variable('cache', 'cached_value', init, k_BLKD.shape, k_BLKD.dtype)
    cache_index = self.variable('cache', 'cache_index', jnp.zeros, (), jnp.int32)
    return (cached_key, cached_value, cache_index) if initialized else None

  def _write_cache(self, cache, k_BLKD, v_BLKD):
    """Writes the new keys and values at the cache index, advances it; returns the whole cache."""
    cached_key, cached_value, cache_index = cache
    index = cache_index.value
    k_BSKD = nn.with_logical_constraint(
        jax.lax.dynamic_update_slice(cached_key.value, k_BLKD, (0, index, 0, 0)), CACHE_AXES
    )
    v_BSKD = nn.with_logical_constraint(
        jax.lax.dynamic_update_slice(cached_value.value, v_BLKD, (0, index, 0, 0)), CACHE_AXES
    )
    cached_key.value, cached_value.value = k_BSKD, v_BSKD
    cache_index.value = index + k_BLKD.shape[1]
    return k_BSKD, v_BSKD


class MLP(nn.Module):
  """Gated MLP: wo(silu(wi_0 x) * wi_1 x)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BLE):
    cfg = self.config
    e, m = cfg.emb_dim, cfg.mlp_dim
    gate_BLM = DenseGeneral((e,), (m,), ('embed', 'mlp'), cfg, name='wi_0')(x_BLE)
    up_BLM = DenseGeneral((e,), (m,), ('embed', 'mlp'), cfg, name='wi_1')(x_BLE)
    hidden_BLM = nn.with_logical_constraint(
        jax.nn.silu(gate_BLM) * up_BLM,
        ('activation_batch', 'activation_length', 'activation_mlp'),
    )
    return DenseGeneral((m,), (e,), ('mlp', 'embed'), cfg, name='wo')(hidden_BLM)

