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

That read costs about 1 ms per thousand maps, mostly in the kernel (30 ms at
30,000); after every test of a worker it came to several seconds of CPU in a
warm suite. `Guard`, which the pytest plugin calls after each test, reads
the count only as often as the headroom below the threshold requires.
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
  return _release_if_over(fraction * map_limit())[0]


def _release_if_over(threshold: float) -> tuple[bool, int | None]:
  """(whether jax's caches were cleared, the map count read); (False, None) without a read."""
  if 'jax' not in sys.modules:
    return False, None
  count = map_count()
  if count is None or count <= threshold:
    return False, count
  import gc

  import jax

  jax.clear_caches()
  gc.collect()
  return True, count


# Above the most maps one test of this suite was seen to add (about 2,500, a
# scenario's train steps on the 3-axis mesh, both sides, on jax 0.10).
MAPS_PER_TEST_BOUND = 4000


class Guard:
  """`release_programs_near_limit` after each test, reading the count only as often as needed.

  After a read of `count` maps below the threshold, the next
  `(threshold - count) // bound` tests are not read, where `bound` is the
  larger of `MAPS_PER_TEST_BOUND` and the most maps seen added between two
  reads (so a suite of larger programs is read more often): while no test
  adds more than the bound, the count at the next read is at most one
  bound above the threshold, which is half the kernel's limit.
  """

  def __init__(self, fraction: float = 0.5):
    self.fraction = fraction
    self.bound = MAPS_PER_TEST_BOUND
    self.skip = 0
    self._last: int | None = None

  def after_test(self) -> bool:
    """Returns whether jax's caches were cleared."""
    if self.skip > 0:
      self.skip -= 1
      return False
    threshold = self.fraction * map_limit()
    cleared, count = _release_if_over(threshold)
    if cleared or count is None:
      self._last = None
      return cleared
    if self._last is not None:
      self.bound = max(self.bound, count - self._last)
    self._last = count
    self.skip = int(threshold - count) // self.bound
    return False
