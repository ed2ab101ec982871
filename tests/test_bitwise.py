"""The comparison helper itself: it must see one flipped bit anywhere, and ±0."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity.core.bitwise import assert_bitwise_equal, compare_trees, raw_bits


def _large_tree():
  keys = jax.random.split(jax.random.PRNGKey(0), 40)
  return {
      f'layer_{i}': {
          'kernel': jax.random.normal(k, (64, 96), jnp.float32),
          'scale': jnp.ones((96,), jnp.bfloat16),
          'count': jnp.arange(7, dtype=jnp.int32),
      }
      for i, k in enumerate(keys)
  }


def test_single_flipped_bit_in_large_tree_is_found_and_reported():
  a = _large_tree()
  b = jax.tree.map(lambda x: x, a)
  kernel = np.array(b['layer_27']['kernel'])
  bits = kernel.view(np.uint32)
  bits[13, 41] ^= 1  # lowest mantissa bit: one ULP
  b['layer_27']['kernel'] = jnp.asarray(kernel)
  diffs = compare_trees(a, b)
  assert [d.path for d in diffs] == ['layer_27/kernel']
  detail = diffs[0].detail
  assert '1 of 6144 elements differ' in detail
  assert 'max ULP distance 1' in detail
  assert 'first at index [13, 41]' in detail
  with pytest.raises(AssertionError, match='layer_27/kernel'):
    assert_bitwise_equal(a, b)


def test_negative_zero_differs_from_positive_zero():
  assert compare_trees({'x': jnp.float32(0.0)}, {'x': jnp.float32(-0.0)})
  assert compare_trees({'x': jnp.zeros(3, jnp.bfloat16)}, {'x': -jnp.zeros(3, jnp.bfloat16)})


def test_a_difference_across_zero_says_so():
  """Tiny values of opposite sign are hundreds of millions of ULP apart (every float between counts),
  and -0.0 against +0.0 is 0 ULP apart: the detail names the elements of opposite sign."""
  tiny = np.array([1e-30, 2.0, 0.0], np.float32)
  detail = compare_trees({'x': tiny}, {'x': np.array([-1e-30, 2.0, -0.0], np.float32)})[0].detail
  assert '2 of 3 elements differ' in detail and '2 of them of opposite sign' in detail, detail
  across = 2 * int(tiny[:1].view(np.uint32)[0])  # the floats from -1e-30 to +1e-30 (457,475,264)
  assert 'max abs diff 2e-30' in detail and f'max ULP distance {across},' in detail, detail
  same_sign = compare_trees({'x': tiny}, {'x': np.nextafter(tiny, np.float32(1))})[0].detail
  assert 'opposite sign' not in same_sign, same_sign
  half = compare_trees({'x': jnp.ones(2, jnp.bfloat16)}, {'x': -jnp.ones(2, jnp.bfloat16)})[0].detail
  assert '2 of them of opposite sign' in half, half


def test_nan_payloads_count():
  a = np.array([np.nan], np.float32)
  b = a.copy()
  b.view(np.uint32)[0] ^= 1
  assert np.isnan(b[0])
  assert compare_trees({'x': a}, {'x': b})
  assert not compare_trees({'x': a}, {'x': a.copy()})


def test_shape_dtype_and_structure_differences_are_reported():
  diffs = compare_trees(
      {'a': jnp.zeros(3), 'b': jnp.zeros(3), 'c': jnp.zeros(2)},
      {'a': jnp.zeros(4), 'b': jnp.zeros(3, jnp.bfloat16), 'd': jnp.zeros(2)},
  )
  kinds = {(d.path, d.kind) for d in diffs}
  assert kinds == {('a', 'shape'), ('b', 'dtype'), ('c', 'missing'), ('d', 'extra')}


def test_equal_trees_pass():
  tree = _large_tree()
  assert_bitwise_equal(tree, jax.tree.map(lambda x: x + 0, tree))
  assert raw_bits(jnp.float32(1.0)) == np.uint32(0x3F800000)


def test_typed_prng_keys_compare_by_key_type_shape_and_key_data():
  """NNX's `RngKey` holds a typed key array, which numpy cannot hold: its key data is compared."""
  from parity.core.bitwise import digest

  key = jax.random.key(0)
  assert compare_trees({'k': key}, {'k': jax.random.key(0)}) == []
  other = compare_trees({'k': key}, {'k': jax.random.key(1)})
  assert [(d.path, d.kind) for d in other] == [('k', 'bits')], other
  assert other[0].detail.startswith('key<fry> key data uint32[2]: '), other[0].detail
  impl = compare_trees({'k': key}, {'k': jax.random.key(0, impl='rbg')})
  assert [(d.path, d.kind, d.detail) for d in impl] == [('k', 'dtype', 'key<fry> vs key<rbg>')]
  shape = compare_trees({'k': key}, {'k': jax.random.split(key, 2)})
  assert [(d.path, d.kind) for d in shape] == [('k', 'shape')]
  assert digest({'k': key}) == digest({'k': jax.random.key(0)}) != digest({'k': jax.random.key(1)})


def test_a_path_in_one_tree_only_names_that_tree():
  a, b = {'x': np.zeros(2), 'only_a': np.ones(1)}, {'x': np.zeros(2), 'only_b': np.ones(1)}
  assert [str(d) for d in compare_trees(a, b)] == [
      'only_a: missing: only in the first tree', 'only_b: extra: only in the second tree']
  assert [str(d) for d in compare_trees(a, b, ('Linen', 'NNX'))] == [
      'only_a: missing: only in Linen', 'only_b: extra: only in NNX']
