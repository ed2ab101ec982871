"""NNX building blocks: dense (optionally fp8), embedding, RMSNorm, RoPE, dropout, attention, MLP.

Mirrors models/linen/layers.py class for class. Submodules are attributes
named as the Linen submodules, so parameter paths are the same. Parameters
carry logical axes as `out_sharding` metadata (parity.core.compat.nnx_param);
activations through `logical_constraint` (a no-op outside a mesh). Attention's
decode mode keeps a KV cache in `nnx.Cache` variables (models/nnx/decode.py).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from flax.linen import spmd as flax_spmd

from parity.core import compat
from models.config import ModelConfig

Axes = tuple[str | None, ...]

# Large negative but finite, so fully masked rows (padding) give no NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Logical axes of a cached key or value, [batch, max length, kv heads, head dim].
CACHE_AXES = ('cache_batch', 'cache_length', 'cache_kv_heads', 'cache_kv_head_dim')


def logical_constraint(x: jax.Array, logical_axes: Axes) -> jax.Array:
  """Constrains an activation by logical axis names, using the context rules.

  flax's logical-to-mesh resolution (priority rules, unmatched names left
  unsharded) is a framework-neutral helper; the constraint itself is applied
  here, so a constraint dropped on this side is a visible difference.
  """
  rules = flax_spmd.get_logical_axis_rules()
  if not rules or not compat.mesh_is_active():
    return x
  spec = flax_spmd.logical_to_mesh_axes(logical_axes, rules)
  return jax.lax.with_sharding_constraint(x, spec)


def kernel_init(in_axis, out_axis) -> jax.nn.initializers.Initializer:
  return jax.nn.initializers.variance_scaling(
      1.0, 'fan_in', 'truncated_normal', in_axis=in_axis, out_axis=out_axis
  )


class Fp8Meta(nnx.Variable):
  """fp8 delayed-scaling state: an amax history or a scale.

  Not a parameter: the train step overwrites it with its "gradient" (the
  next value, which the fp8 op's backward pass returns for it) and the
  optimizer (`wrt=nnx.Param`) never sees it. No sharding metadata: it is
  replicated on a mesh, like Linen's unboxed `_overwrite_with_gradient`.
  """


class Fp8DotGeneral(nnx.Module):
  """fp8 dot product with delayed scaling (e4m3 forward, e5m2 gradients).

  The state and math of flax's `Fp8DirectDotGeneralOp` (which the Linen side
  uses), with its state held in `Fp8Meta` variables. The op itself,
  `fp8_ops.fp8_scaled_dot_general`, is a stateless function with a custom
  VJP, shared as `jax.lax.dot_general` is.
  """

  def __init__(self, amax_history_length: int):
    history = jnp.zeros((amax_history_length,), jnp.float32)
    scale = jnp.ones((1,), jnp.float32)
    self.input_amax_history = Fp8Meta(history)
    self.kernel_amax_history = Fp8Meta(history)
    self.output_grad_amax_history = Fp8Meta(history)
    self.input_scale = Fp8Meta(scale)
    self.kernel_scale = Fp8Meta(scale)
    self.output_grad_scale = Fp8Meta(scale)

  def __call__(self, x: jax.Array, kernel: jax.Array, dimension_numbers) -> jax.Array:
    dtype = kernel.dtype
    x = x.astype(dtype)
    return fp8_ops.fp8_scaled_dot_general(
        x,
        kernel,
        dimension_numbers,
        preferred_element_type=dtype,
        lhs_scale=self.input_scale[...],
        rhs_scale=self.kernel_scale[...],
        grad_scale=self.output_grad_scale[...],
        lhs_amax_history=self.input_amax_history[...],
        rhs_amax_history=self.kernel_amax_history[...],
        grad_amax_history=self.output_grad_amax_history[...],
        quantize_compute_type=dtype,
    )


class DenseGeneral(nnx.Module):
  """y = x . kernel over the trailing `len(in_features)` axes of x."""

  def __init__(
      self,
      in_features: tuple[int, ...],
      out_features: tuple[int, ...],
      logical_axes: Axes,
      config: ModelConfig,
      *,
      rngs: nnx.Rngs,
  ):
    n_in, n_out = len(in_features), len(out_features)
    init = kernel_init(tuple(range(n_in)), tuple(range(n_in, n_in + n_out)))
    self.n_in = n_in
    self.config = config
    self.kernel = compat.nnx_param(
        init(rngs.params(), in_features + out_features, jnp.dtype(config.weight_dtype)),
        logical_axes,
    )
    if config.quantization == 'fp8':
      self.dot_general = Fp8DotGeneral(config.fp8_amax_history_length)

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = jnp.dtype(self.config.activation_dtype)
    contract_x = tuple(range(x.ndim - self.n_in, x.ndim))
    dot_general = jax.lax.dot_general
    if self.config.quantization == 'fp8':
      dot_general = self.dot_general
    return dot_general(
        x.astype(dtype),
        self.kernel[...].astype(dtype),
        ((contract_x, tuple(range(self.n_in))), ((), ())),
    )


class Embed(nnx.Module):
  """Token embedding table; `attend` computes logits through it (tied)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    init = jax.nn.initializers.normal(stddev=1.0)
    self.embedding = compat.nnx_param(
        init(rngs.params(), (config.vocab_size, config.emb_dim), jnp.dtype(config.weight_dtype)),
        ('vocab', 'embed_vocab'),
    )

  def __call__(self, inputs_BL: jax.Array) -> jax.Array:
    dtype = jnp.dtype(self.config.activation_dtype)
    return jnp.take(self.embedding[...], inputs_BL, axis=0).astype(dtype)

  def attend(self, x_BLE: jax.Array) -> jax.Array:
    dtype = jnp.dtype(self.config.activation_dtype)
    return jnp.einsum('ble,ve->blv', x_BLE.astype(dtype), self.embedding[...].astype(dtype))


class RMSNorm(nnx.Module):
  """Root-mean-square norm, statistics in float32."""

  def __init__(self, num_features: int, config: ModelConfig, *, rngs: nnx.Rngs):
    del rngs  # ones: nothing random, taken for a uniform constructor
    self.config = config
    self.scale = compat.nnx_param(
        jnp.ones((num_features,), jnp.dtype(config.weight_dtype)), ('norm',)
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    dtype = jnp.dtype(cfg.activation_dtype)
    x32 = x.astype(jnp.float32)
    mean_sq = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = (x32 * jax.lax.rsqrt(mean_sq + cfg.norm_epsilon)).astype(dtype)
    return y * self.scale[...].astype(dtype)


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


class Dropout(nnx.Module):
  """Inverted dropout with an explicit key (never an `nnx.Rngs` stream)."""

  def __init__(self, rate: float):
    self.rate = rate
    self.deterministic = False  # set by Module.eval()

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


class Attention(nnx.Module):
  """Causal, segment-masked grouped-query attention with RoPE.

  Decoding: `init_cache` creates the cache (the most tokens it will hold),
  then `decode = True` (`model.set_attributes(decode=True)`); each call
  writes its tokens' keys and values at `cache_index` and attends to the
  cache. Decoding reads positions from `cache_index` (not `positions_BL`)
  and assumes one segment per row (`segment_ids_BL` is not read).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    cfg = self.config = config
    e, n, k, d = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.query = DenseGeneral((e,), (n, d), ('embed', 'q_heads', 'kv'), cfg, rngs=rngs)
    self.key = DenseGeneral((e,), (k, d), ('embed', 'kv_heads', 'kv_head_dim'), cfg, rngs=rngs)
    self.value = DenseGeneral((e,), (k, d), ('embed', 'kv_heads', 'kv_head_dim'), cfg, rngs=rngs)
    self.out = DenseGeneral((n, d), (e,), ('heads', 'kv', 'embed'), cfg, rngs=rngs)
    self.decode = False  # set_attributes(decode=True), after init_cache

  def init_cache(self, batch: int, max_len: int):
    """Creates the empty cache: `cached_key`, `cached_value` [batch, max_len, kv heads, head dim]
    and `cache_index`, a scalar, replicated: no logical axes (as on the Linen side; and
    `nnx.scan` cannot carry an empty `out_sharding` through, flax 0.12.8 and 0.12.12)."""
    cfg = self.config
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.activation_dtype)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype), **compat.nnx_axes_metadata(CACHE_AXES))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype), **compat.nnx_axes_metadata(CACHE_AXES))
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

  def __call__(self, x_BLE, positions_BL, segment_ids_BL):
    cfg = self.config
    n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x_BLE = logical_constraint(
        x_BLE, ('activation_batch', 'activation_attn_length', 'activation_attn_embed')
    )
    q_BLND = self.query(x_BLE)
    k_BLKD = self.key(x_BLE)
    v_BLKD = self.value(x_BLE)
    b, length = x_BLE.shape[:2]
    if self.decode:
      positions_BL = cache_positions(self.cache_index[...], b, length)
    qkv_axes = (
        'activation_kv_batch', 'activation_attn_length',
        'activation_kv_heads', 'activation_kv_head_dim',
    )
    q_BLND = logical_constraint(apply_rope(q_BLND, positions_BL, cfg), qkv_axes)
    k_BLKD = logical_constraint(apply_rope(k_BLKD, positions_BL, cfg), qkv_axes)
    v_BLKD = logical_constraint(v_BLKD, qkv_axes)

    # Two branches around the first einsum, so that training traces its ops in the order it
    # always has (the mask after the einsum): the same program as before decoding existed.
    if not self.decode:
      k_BSKD, v_BSKD = k_BLKD, v_BLKD
    else:
      k_BSKD, v_BSKD = self._write_cache(k_BLKD, v_BLKD)
    q_BLKGD = (q_BLND * d**-0.5).reshape(b, length, k, n // k, d)
    logits_BKGLS = jnp.einsum(
        'blkgd,bskd->bkgls', q_BLKGD, k_BSKD, preferred_element_type=jnp.float32
    )
    if not self.decode:
      causal_LS = jnp.tril(jnp.ones((length, length), jnp.bool_))
      same_segment_BLS = segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :]
      mask_BLS = causal_LS[None] & same_segment_BLS
    else:
      mask_BLS = cache_mask(positions_BL, k_BSKD.shape[1])
    logits_BKGLS = jnp.where(mask_BLS[:, None, None], logits_BKGLS, MASK_VALUE)
    probs_BKGLS = jax.nn.softmax(logits_BKGLS, axis=-1).astype(q_BLND.dtype)
    out_BLKGD = jnp.einsum('bkgls,bskd->blkgd', probs_BKGLS, v_BSKD)
    out_BLND = logical_constraint(
        out_BLKGD.reshape(b, length, n, d),
        ('activation_batch', 'activation_attn_length', 'activation_heads', 'activation_kv'),
    )
    return self.out(out_BLND)

  def _write_cache(self, k_BLKD, v_BLKD):
    """Writes the new keys and values at the cache index, advances it; returns the whole cache."""
    index = self.cache_index[...]
    k_BSKD = logical_constraint(
        jax.lax.dynamic_update_slice(self.cached_key[...], k_BLKD, (0, index, 0, 0)), CACHE_AXES
    )
    v_BSKD = logical_constraint(
        jax.lax.dynamic_update_slice(self.cached_value[...], v_BLKD, (0, index, 0, 0)), CACHE_AXES
    )
    self.cached_key[...], self.cached_value[...] = k_BSKD, v_BSKD
    self.cache_index[...] = index + k_BLKD.shape[1]
    return k_BSKD, v_BSKD


class MLP(nnx.Module):
  """Gated MLP: wo(silu(wi_0 x) * wi_1 x)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    e, m = config.emb_dim, config.mlp_dim
    self.wi_0 = DenseGeneral((e,), (m,), ('embed', 'mlp'), config, rngs=rngs)
    self.wi_1 = DenseGeneral((e,), (m,), ('embed', 'mlp'), config, rngs=rngs)
    self.wo = DenseGeneral((m,), (e,), ('mlp', 'embed'), config, rngs=rngs)

  def __call__(self, x_BLE):
    # Both projections before the activation, as on the Linen side: the
    # trace order decides the order of a scan's saved residuals, and with it
    # XLA's buffer assignment (measured: 4,928 bytes more temporaries on the
    # 3-axis mesh with gradient accumulation when silu came first).
    gate_BLM = self.wi_0(x_BLE)
    up_BLM = self.wi_1(x_BLE)
    hidden_BLM = logical_constraint(
        jax.nn.silu(gate_BLM) * up_BLM,
        ('activation_batch', 'activation_length', 'activation_mlp'),
    )
    return self.wo(hidden_BLM)
