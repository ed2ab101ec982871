"""The one RNG-key scheme for dropout, shared by both sides.

Neither `make_rng` nor `nnx.Rngs` streams are used for dropout: their key
derivations differ between Linen and NNX, so masks could never match. Every
dropout mask's key is instead a pure function of

  (base key, step, microbatch, layer, site)

built with `jax.random.fold_in`, in that order. Each side receives per-layer
keys as an argument (scanned layers get them as scan inputs) and folds in the
site itself. A mask that fails to change between steps, layers or
microbatches is therefore a bug a test can see.

Keys are raw uint32[2] arrays (`jax.random.PRNGKey` form), so they travel in
checkpoints and through `jax.lax.scan` like any other array.
"""
from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from parity.core.rng import base_key, step_key  # noqa: F401  (the kit's step keys; this module adds layers and sites)


class Site(enum.IntEnum):
  """Where in a layer a dropout mask is drawn."""

  EMBEDDING = 0  # decoder input (drawn with layer index -1)
  ATTENTION_OUTPUT = 1
  MLP_OUTPUT = 2


EMBEDDING_LAYER = -1


def layer_keys(key: jax.Array, num_layers: int) -> jax.Array:
  """uint32[num_layers, 2]: one key per decoder layer, for scan inputs."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(
      jnp.arange(num_layers, dtype=jnp.uint32)
  )


def embedding_key(key: jax.Array) -> jax.Array:
  """Key of the embedding-output dropout (layer index -1)."""
  return jax.random.fold_in(key, jnp.uint32(2**32 - 1))


def site_key(layer_key: jax.Array, site: Site) -> jax.Array:
  """Key of one dropout site inside a layer."""
  return jax.random.fold_in(layer_key, int(site))
