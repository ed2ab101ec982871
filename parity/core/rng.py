"""The step-key helpers: a run's dropout base key, and the key of one (step, microbatch).

A pair's train step receives `dropout_base` and derives each step's key with
`step_key(dropout_base, step, microbatch)`, the same function on both sides,
so masks can be equal and a mask that fails to change between steps is a bug
a test can see. Keys are raw uint32[2] arrays (`jax.random.PRNGKey` form), so
they travel in checkpoints and through `jax.lax.scan` like any other array.

Called outside a trace, each helper runs as one jitted program: eagerly, jax
compiles a program per operation (seeding, each fold-in, each conversion),
and the battery counts programs. Inside a trace they are inlined as written,
so a train step's program is the same as before.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from parity.core import compat


def _traced(*args) -> bool:
  """Whether to inline: inside a trace, or given traced values."""
  return not compat.eager() or any(isinstance(a, jax.core.Tracer) for a in args)


def _base_key(seed) -> jax.Array:
  return jax.random.fold_in(jax.random.PRNGKey(seed), 0x0D0)


def _step_key(base, step, microbatch) -> jax.Array:
  key = jax.random.fold_in(base, jnp.asarray(step, jnp.uint32))
  return jax.random.fold_in(key, jnp.asarray(microbatch, jnp.uint32))


def _decode_key(seed) -> jax.Array:
  return jax.random.fold_in(_base_key(seed), 1)


@jax.jit
def _run_keys(seed) -> tuple[jax.Array, jax.Array, jax.Array]:
  base = _base_key(seed)
  return base, _step_key(base, 0, 0), _decode_key(seed)


@functools.lru_cache(maxsize=64)
def _keys_of(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A run's base key, its first step's key and its decode key: one program, once per seed."""
  return _run_keys(seed)


_step_key_program = jax.jit(_step_key)


def base_key(seed: int) -> jax.Array:
  """The dropout base key of a run (kept in the train state for resumes)."""
  return _keys_of(int(seed))[0] if not _traced(seed) else _base_key(seed)


def step_key(base: jax.Array, step: jax.Array | int, microbatch: jax.Array | int) -> jax.Array:
  """Key of one (step, microbatch): the parent of all its layer keys."""
  if _traced(base, step, microbatch):
    return _step_key(base, step, microbatch)
  return _step_key_program(base, step, microbatch)


def first_step_key(seed: int) -> jax.Array:
  """`step_key(base_key(seed), 0, 0)`: the key of a run's first step and microbatch."""
  return _keys_of(int(seed))[1] if not _traced(seed) else _step_key(_base_key(seed), 0, 0)


def decode_key(seed: int) -> jax.Array:
  """The sampling key of the battery's decode part."""
  return _keys_of(int(seed))[2] if not _traced(seed) else _decode_key(seed)
