"""Sampling a decoded token, shared by both sides' decoding (models/linen/decode.py, models/nnx/decode.py).

Stateless, like the dropout-key scheme (models/rng.py): the same function of
(logits, key, step, temperature) on both sides, so sampled tokens can be equal.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def step_key(key: jax.Array, step) -> jax.Array:
  """The sampling key of decoding step `step` (from 0)."""
  return jax.random.fold_in(key, step)


@functools.partial(jax.jit, static_argnames='temperature')
def sample(logits_BLV, key, step, temperature: float):
  """(int32[B] token, float32[B, V] logits it was drawn from) of the last position.

  Greedy at temperature 0, else a draw from softmax(logits / temperature).
  """
  logits_BV = logits_BLV[:, -1].astype(jnp.float32)
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), logits_BV
  token_B = jax.random.categorical(step_key(key, step), logits_BV / temperature, axis=-1)
  return token_B.astype(jnp.int32), logits_BV
