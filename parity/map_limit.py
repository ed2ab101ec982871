"""Keeps a long test process under Linux's limit on memory maps.

XLA:CPU maps memory for every program it compiles (about 6 maps each on jax
0.10) and keeps them while jax holds the program: in the jitted function's
cache, for as long as the function lives. A test process that compiles many
programs (a worker running a large share of a suite, each module keeping its
sides alive for its other tests) passes the kernel's `vm.max_map_count`
(65,530 by default), and the next map fails inside XLA as a segmentation fault
in compilation or in a cache read, not as an error that names the cause.

`release_programs_near_limit` drops jax's in-memory caches once the process
holds more than half of the limit. Nothing is lost but time: a function called
again is traced again and its program loaded from the persistent compilation
cache, or compiled again, to the same bits. Below the threshold it costs one
read of `/proc/self/maps`. Where there is no such file (not Linux), it does
nothing.
"""
from __future__ import annotations

import sys

_MAPS = '/proc/self/maps'
_LIMIT = '/proc/sys/vm/max_map_count'
DEFAULT_LIMIT = 65530


def map_count() -> int | None:
  """This process's memory maps, or None where the system does not say."""
  try:
    with open(_MAPS, 'rb') as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def map_limit() -> int:
  try:
    with open(_LIMIT) as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return DEFAULT_LIMIT


def release_programs_near_limit(fraction: float = 0.5) -> bool:
  """Clears jax's caches if this process holds more than `fraction` of the limit.

  Returns whether it cleared them. Does nothing if jax is not imported.
  """
  if 'jax' not in sys.modules:
    return False
  count = map_count()
  if count is None or count <= fraction * map_limit():
    return False
  import gc

  import jax

  jax.clear_caches()
  gc.collect()
  return True
