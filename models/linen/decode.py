"""Autoregressive decoding with a KV cache (Linen): prefill, then one token per step.

Mirrors models/nnx/decode.py. The model runs with `decode=True`; its cache
is the 'cache' collection, created by an `init` at the full length and
carried through `apply(..., mutable=['cache'])`. Scanned layers stay
scanned: the cache is stacked with them (decoder.CACHE_SCAN_AXIS).

The prompt (every position in one call) and each new token go through one
jitted `extend`: two compiles per batch and length, one for the prompt's
length and one for a single token. A decoding step's key is
`fold_in(key, step)` (`step_key`, the same function on the NNX side).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.sampling import draw_tokens, sample, step_key  # noqa: F401  (shared: the same draw on both sides)
from models.linen.decoder import Transformer
from parity.core import paths


def _model(model_cfg: ModelConfig) -> Transformer:
  return Transformer(model_cfg, deterministic=True, decode=True)


def _init_variables(model_cfg: ModelConfig, batch: int, max_len: int):
  """Every collection of a decoding `init` at the full length, boxed (the cache among them)."""
  tokens_BL = jnp.zeros((batch, max_len), jnp.int32)
  positions_BL = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
  return _model(model_cfg).init(
      {'params': jax.random.PRNGKey(0)},
      tokens_BL, positions_BL, jnp.ones_like(tokens_BL), jnp.zeros((2,), jnp.uint32),
  )


def abstract_cache(model_cfg: ModelConfig, batch: int, max_len: int):
  """The boxed cache collection as ShapeDtypeStructs: its logical axes, nothing allocated."""
  return jax.eval_shape(lambda: _init_variables(model_cfg, batch, max_len))['cache']


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def init_cache(model_cfg: ModelConfig, batch: int, max_len: int):
  """The empty cache collection, for `batch` rows and up to `max_len` tokens.

  Unboxed: under a mesh and rules, `nn.unbox` constrains each array to the
  sharding its logical axes give (the parameters' init, which jit prunes,
  is not computed).
  """
  return nn.unbox(_init_variables(model_cfg, batch, max_len)['cache'])


@functools.partial(jax.jit, static_argnums=0)
def extend(model_cfg: ModelConfig, variables, cache, tokens_BL):
  """(logits of `tokens_BL`, the cache after): the tokens written at the cache index on.

  `variables` are the model's (`{'params': ...}`, with any fp8 state). No
  positions or segments are given: the model reads positions from its cache
  index, and a decoded row is one segment.
  """
  logits_BLV, mutated = _model(model_cfg).apply(
      {**variables, 'cache': cache}, tokens_BL, None, None, jnp.zeros((2,), jnp.uint32),
      mutable=['cache'],
  )
  return logits_BLV, mutated['cache']


def lower_step(model_cfg: ModelConfig, variables, batch: int, max_len: int) -> jax.stages.Lowered:
  """One decoding step's program (a token a row, on a cache of `max_len`), as `decode` runs it:
  for its memory analysis and program comparison (`parity compare --decode`)."""
  return extend.lower(model_cfg, variables, init_cache(model_cfg, batch, max_len), jnp.zeros((batch, 1), jnp.int32))


def prefill(model_cfg: ModelConfig, variables, prompt_BP, max_len: int):
  """(the prompt's logits at every position, the cache they wrote) in one call."""
  cache = init_cache(model_cfg, prompt_BP.shape[0], max_len)
  return extend(model_cfg, variables, cache, prompt_BP)


def decode(model_cfg: ModelConfig, variables, prompt_BP, steps: int, key, temperature: float):
  """`steps` tokens after the prompt: (int32[B, steps] tokens, float32[B, steps, V] logits each
  was drawn from, the final cache as `{'cache/<module path>/<name>': array}`).

  Token 0 comes from the prefill's last logits, token i from the step that
  fed token i - 1. The cache holds prompt + steps positions (the last token
  is drawn, not fed: its slot stays empty).
  """
  logits_BLV, cache = prefill(model_cfg, variables, prompt_BP, prompt_BP.shape[1] + steps)

  def feed(tokens_B1):
    nonlocal cache
    logits_BLV, cache = extend(model_cfg, variables, cache, tokens_B1)
    return logits_BLV

  tokens, logits = draw_tokens(logits_BLV, feed, steps, key, temperature)
  return tokens, logits, paths.flatten({'cache': cache})
