"""jax's persistent compilation cache for a session that runs the battery, unless one is set.

A pair's battery is mostly XLA compiling both sides (a small language model:
over 100 programs); with the cache, a second run of the same pair loads them.
A cache hit is the same executable, bit for bit: the cache is keyed by the
program, the jax version and the flags. The plugin sets it where the user has
not: JAX_COMPILATION_CACHE_DIR or jax's `jax_compilation_cache_dir` wins, and
gets SETTINGS too, each unless its environment variable is set.
"""
from __future__ import annotations

import os
import sys

# Every program (jax's defaults skip those compiled in under a second, most of a small pair's),
# and a size limit, which turns on jax's file lock around each read and write (workers share it).
SETTINGS = {
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
    'JAX_COMPILATION_CACHE_MAX_SIZE': str(8 * 2**30),
}


def enable(directory: str) -> str:
  """Points jax's persistent compilation cache at `directory` unless one is set already;
  returns the directory in use. Before jax starts it sets the environment jax reads; after,
  jax's config (which takes effect where nothing has compiled yet). A cache of the user's own
  gets the same settings, each where the environment does not set it: without them jax skips
  every program compiled in under a second, most of a small pair's."""
  given = os.environ.get('JAX_COMPILATION_CACHE_DIR')
  jax = sys.modules.get('jax')
  if jax is not None:
    given = given or jax.config.jax_compilation_cache_dir
  if not given:
    if jax is None:
      os.environ['JAX_COMPILATION_CACHE_DIR'] = directory
    else:
      jax.config.update('jax_compilation_cache_dir', directory)
  _settle(jax)
  return given or directory


def settle_given() -> bool:
  """SETTINGS for a cache the user names (JAX_COMPILATION_CACHE_DIR or jax's config), each where
  the environment does not set it; True where one is named."""
  jax = sys.modules.get('jax')
  given = os.environ.get('JAX_COMPILATION_CACHE_DIR') or (jax is not None and jax.config.jax_compilation_cache_dir)
  if given:
    _settle(jax)
  return bool(given)


def _settle(jax) -> None:
  """SETTINGS, each where the environment does not set it."""
  for name, value in SETTINGS.items():
    if name in os.environ:
      continue
    if jax is None:
      os.environ[name] = value
    else:
      jax.config.update(name.lower(), int(value))
