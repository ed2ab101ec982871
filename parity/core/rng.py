"""The step-key helpers: a run's dropout base key, and the key of one (step, microbatch).

A pair's train step receives `dropout_base` and derives each step's key with
`step_key(dropout_base, step, microbatch)`, the same function on both sides,
so masks can be equal and a mask that fails to change between steps is a bug
a test can see. Keys are raw uint32[2] arrays (`jax.random.PRNGKey` form), so
they travel in checkpoints and through `jax.lax.scan` like any other array.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def base_key(seed: int) -> jax.Array:
  """The dropout base key of a run (kept in the train state for resumes)."""
  return jax.random.fold_in(jax.random.PRNGKey(seed), 0x0D0)


def step_key(base: jax.Array, step: jax.Array | int, microbatch: jax.Array | int) -> jax.Array:
  """Key of one (step, microbatch): the parent of all its layer keys."""
  key = jax.random.fold_in(base, jnp.asarray(step, jnp.uint32))
  return jax.random.fold_in(key, jnp.asarray(microbatch, jnp.uint32))
