"""The guard that keeps a long test process under Linux's memory-map limit."""
import jax
import jax.numpy as jnp
import pytest

from parity.env import map_limit
from parity.core.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.skipif(
    map_limit.map_count() is None, reason='no /proc/self/maps: not Linux, no map limit to guard'
)

pytest_plugins = ['pytester']

PROGRAMS = 40


def test_below_the_threshold_nothing_is_released():
  assert map_limit.map_count() < map_limit.map_limit()
  assert not map_limit.release_programs_near_limit(fraction=1.0)


@pytest.mark.exhaustive
def test_released_programs_are_unmapped_and_compute_the_same_bits():
  x = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)
  functions = [jax.jit(lambda x, i=i: jnp.sin(x * i) @ x + i) for i in range(PROGRAMS)]
  before = [f(x) for f in functions]
  jax.block_until_ready(before)
  held = map_limit.map_count()
  assert map_limit.release_programs_near_limit(fraction=0.0)
  released = map_limit.map_count()
  # Each compiled program holds at least one map (about 6 on jax 0.10).
  assert held - released >= PROGRAMS, (held, released)
  after = [f(x) for f in functions]
  for b, a in zip(before, after):
    assert_bitwise_equal(b, a)


def _fake_counts(monkeypatch, count):
  """map_count returns `count[0]`; returns the list of counts read."""
  reads = []
  monkeypatch.setattr(map_limit, 'map_count', lambda: reads.append(count[0]) or count[0])
  monkeypatch.setattr(map_limit, 'map_limit', lambda: 65530)
  return reads


def test_the_guard_reads_less_often_the_further_below_the_threshold(monkeypatch):
  count = [1000]
  reads = _fake_counts(monkeypatch, count)
  guard = map_limit.Guard()
  skipped = (65530 // 2 - 1000) // map_limit.MAPS_PER_TEST_BOUND
  assert skipped >= 2
  for _ in range(skipped + 2):
    assert not guard.after_test()
  assert len(reads) == 2  # the first test and the one after the skipped ones

  count[0] = 65530 // 2 - 10  # near the threshold: a read after every test
  reads.clear()
  guard = map_limit.Guard()
  for _ in range(3):
    assert not guard.after_test()
  assert len(reads) == 3


def test_the_guard_reads_more_often_after_a_large_growth(monkeypatch):
  count = [1000]
  reads = _fake_counts(monkeypatch, count)
  guard = map_limit.Guard()
  guard.after_test()
  assert guard.skip >= 2
  for _ in range(guard.skip):
    guard.after_test()
  count[0] += 3 * map_limit.MAPS_PER_TEST_BOUND  # added between the two reads
  guard.after_test()
  assert len(reads) == 2
  assert guard.skip == (65530 // 2 - count[0]) // (3 * map_limit.MAPS_PER_TEST_BOUND)


def test_the_guard_clears_above_the_threshold(monkeypatch):
  import jax

  count = [65530 // 2 + 1]
  _fake_counts(monkeypatch, count)
  cleared = []
  monkeypatch.setattr(jax, 'clear_caches', lambda: cleared.append(True))
  assert map_limit.Guard().after_test()
  assert cleared == [True]


PATCHED_COUNT = """
import jax
from parity.env import map_limit
from parity.battery import plugin

CLEARED = []


def test_patches_the_count(monkeypatch):
  plugin._MAP_GUARD.skip = 0  # the guard reads after this test
  monkeypatch.setattr(map_limit, 'map_count', lambda: 10**9)
  monkeypatch.setattr(jax, 'clear_caches', lambda: CLEARED.append(True))


def test_the_guard_read_the_real_count():
  assert CLEARED == []
"""


def test_the_plugins_guard_reads_after_the_tests_patches_are_undone(pytester):
  """The plugin's guard runs after a test's fixtures are torn down.

  Run before them, it read the counts a test had patched in (this module's
  own tests patch them): its skip and growth bound then came from a made-up
  count, and it could go unread far past the threshold.
  """
  pytester.makepyfile(test_patched=PATCHED_COUNT)
  result = pytester.runpytest_inprocess('-p', 'no:cacheprovider')
  result.assert_outcomes(passed=2)
