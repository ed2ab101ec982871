"""Sampling decoded tokens, shared by both sides' decoding (models/linen/decode.py and
models/nnx/decode.py, models/linen/lm.py and models/nnx/lm.py).

Stateless, like the dropout-key scheme (models/rng.py): the same function of
(logits, key, step, temperature) on both sides, so sampled tokens can be
equal; `draw_tokens` is the token loop each side runs around its own model.
"""
from __future__ import annotations

import functools
from typing import Callable

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


def draw_tokens(logits_BLV, feed: Callable[[jax.Array], jax.Array], steps: int, key, temperature: float):
  """(int32[B, steps] tokens, float32[B, steps, V] the logits each was drawn from).

  Token 0 is drawn from the last position of `logits_BLV` (the prefill's),
  token i from the logits `feed(token i - 1 as int32[B, 1])` returns ([B, L, V];
  the side's model call, which advances its cache).
  """
  tokens, drawn_from = [], []
  for step in range(steps):
    if step:
      logits_BLV = jax.block_until_ready(feed(tokens[-1][:, None]))
    # One program at a time: on a mesh of CPU devices, two programs with collectives in flight
    # can each hold some devices' threads waiting for the others (XLA aborts after 40 s).
    token_B, logits_BV = jax.block_until_ready(sample(logits_BLV, key, step, temperature))
    tokens.append(token_B)
    drawn_from.append(logits_BV)
  if not steps:
    return jnp.zeros((logits_BLV.shape[0], 0), jnp.int32), jnp.zeros((logits_BLV.shape[0], 0, logits_BLV.shape[-1]), jnp.float32)
  return jnp.stack(tokens, axis=1), jnp.stack(drawn_from, axis=1)
