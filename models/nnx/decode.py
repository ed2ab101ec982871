"""Autoregressive decoding with a KV cache (NNX): prefill, then one token per step.

Mirrors models/linen/decode.py. The model decodes after `init_cache` and
`set_attributes(decode=True)`; its cache is its `nnx.Cache` variables, split
off as a State and carried through a jitted function that merges the model,
calls it and returns the cache it updated. Scanned layers stay scanned: the
cache is stacked with them (decoder.CACHE_SCAN_AXIS).

The prompt (every position in one call) and each new token go through one
jitted `extend`: two compiles per batch and length, one for the prompt's
length and one for a single token. A decoding step's key is
`fold_in(key, step)` (`step_key`, the same function on the Linen side).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.sampling import draw_tokens, sample, step_key  # noqa: F401  (shared: the same draw on both sides)
from models.nnx.decoder import Transformer
from models.nnx.layers import logical_constraint
from parity.core import compat, paths


def _decoding(model: Transformer, batch: int, max_len: int) -> Transformer:
  """`model`, in place, set to decode (dropout off) with an empty cache."""
  model.init_cache(batch, max_len)
  model.set_attributes(decode=True, deterministic=True)
  return model


def _constrained(cache: nnx.State) -> nnx.State:
  """Each cache array constrained to the sharding its logical axes give (none off a mesh);
  the unannotated index is left as is, as Linen's `nn.unbox` leaves an unboxed array."""

  def constrain(variable):
    axes = compat.nnx_logical_axes(variable)
    if axes is None:
      return variable
    return compat.nnx_variable_with_value(variable, logical_constraint(variable.get_value(), axes))

  return jax.tree.map(constrain, cache, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _abstract_decoding(model: Transformer, batch: int, max_len: int) -> Transformer:
  """A decoding copy of `model` as ShapeDtypeStructs (for its graphdef and cache metadata)."""
  graphdef, state = nnx.split(model)
  return nnx.eval_shape(lambda s: _decoding(nnx.merge(graphdef, s), batch, max_len), state)


def abstract_cache(model: Transformer, batch: int, max_len: int) -> nnx.State:
  """The cache State as ShapeDtypeStructs with its metadata (logical axes), nothing allocated."""
  return nnx.state(_abstract_decoding(model, batch, max_len), nnx.Cache)


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _empty_cache(graphdef, state, batch: int, max_len: int) -> nnx.State:
  return _constrained(nnx.state(_decoding(nnx.merge(graphdef, state), batch, max_len), nnx.Cache))


def init_cache(model: Transformer, batch: int, max_len: int):
  """(graphdef of `model` decoding, its state, the empty cache State); `model` is unchanged.

  The cache is made in a jitted function (the parameters it merges are not
  read); under a mesh and rules its arrays are placed by their logical axes.
  """
  graphdef, state = nnx.split(model)
  decoding = _abstract_decoding(model, batch, max_len)
  return nnx.graphdef(decoding), state, _empty_cache(graphdef, state, batch, max_len)


@functools.partial(jax.jit, static_argnums=0)
def extend(graphdef, state, cache, tokens_BL):
  """(logits of `tokens_BL`, the cache after): the tokens written at the cache index on.

  `graphdef` and `state` are `init_cache`'s. No positions or segments are
  given: the model reads positions from its cache index, and a decoded row
  is one segment.
  """
  model = nnx.merge(graphdef, state, cache)
  logits_BLV = model(tokens_BL, None, None, jnp.zeros((2,), jnp.uint32))
  return logits_BLV, nnx.state(model, nnx.Cache)


def lower_step(model: Transformer, batch: int, max_len: int) -> jax.stages.Lowered:
  """One decoding step's program (a token a row, on a cache of `max_len`), as `decode` runs it:
  for its memory analysis and program comparison (`parity compare --decode`)."""
  graphdef, state, cache = init_cache(model, batch, max_len)
  return extend.lower(graphdef, state, cache, jnp.zeros((batch, 1), jnp.int32))


def prefill(model_cfg: ModelConfig, model: Transformer, prompt_BP, max_len: int):
  """(the prompt's logits at every position, the cache they wrote) in one call."""
  _check_config(model_cfg, model)
  graphdef, state, cache = init_cache(model, prompt_BP.shape[0], max_len)
  return extend(graphdef, state, cache, prompt_BP)


def decode(model_cfg: ModelConfig, model: Transformer, prompt_BP, steps: int, key, temperature: float):
  """`steps` tokens after the prompt: (int32[B, steps] tokens, float32[B, steps, V] logits each
  was drawn from, the final cache as `{'<module path>/<name>': array}`).

  Token 0 comes from the prefill's last logits, token i from the step that
  fed token i - 1. The cache holds prompt + steps positions (the last token
  is drawn, not fed: its slot stays empty).
  """
  _check_config(model_cfg, model)
  graphdef, state, cache = init_cache(model, prompt_BP.shape[0], prompt_BP.shape[1] + steps)
  logits_BLV, cache = extend(graphdef, state, cache, prompt_BP)

  def feed(tokens_B1):
    nonlocal cache
    logits_BLV, cache = extend(graphdef, state, cache, tokens_B1)
    return logits_BLV

  tokens, logits = draw_tokens(logits_BLV, feed, steps, key, temperature)
  return tokens, logits, paths.flatten(cache)


def _check_config(model_cfg: ModelConfig, model: Transformer) -> None:
  if model.config != model_cfg:
    raise ValueError(f'the model was built from another config: {model.config} vs {model_cfg}')
