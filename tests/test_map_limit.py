"""The guard that keeps a long test process under Linux's memory-map limit."""
import jax
import jax.numpy as jnp
import pytest

from parity import map_limit
from parity.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.skipif(
    map_limit.map_count() is None, reason='no /proc/self/maps: not Linux, no map limit to guard'
)

PROGRAMS = 40


def test_below_the_threshold_nothing_is_released():
  assert map_limit.map_count() < map_limit.map_limit()
  assert not map_limit.release_programs_near_limit(fraction=1.0)


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
