"""Native NNX init against native Linen init.

The two frameworks derive init keys differently, so values differ; structure
(paths, shapes, dtypes, logical specs) must be identical and every
parameter's distribution must agree.

Statistical bound: for a parameter with n i.i.d. entries of std s, the
sample mean has std s/sqrt(n) and the sample std has relative std about
1/sqrt(2n). We require |mean_linen - mean_nnx| <= 6 * s * sqrt(2/n) and
|std_linen / std_nnx - 1| <= 6 / sqrt(n) (+ a floor for the 64-entry norm
scales, which are constant ones and compare exactly). At 6 sigma a false
alarm is ~1e-9 per parameter; a wrong initializer (normal instead of
truncated normal, fan_out instead of fan_in, std 1 instead of 1/sqrt(fan_in))
moves the std by far more than that for every kernel here.
"""
import math

import numpy as np
import pytest

from bridge import paths, specs
from parity.bitwise import assert_bitwise_equal


@pytest.fixture(scope='module')
def native(tiny_sides):
  linen, nnx_side = tiny_sides
  linen_params = paths.flatten(linen.init(0).params['params'])
  nnx_params = paths.flatten(nnx_side.params(nnx_side.init(0)))
  return linen_params, nnx_params


def test_structure_shapes_dtypes_equal(native):
  linen_params, nnx_params = native
  assert sorted(linen_params) == sorted(nnx_params)
  for path in linen_params:
    assert linen_params[path].shape == nnx_params[path].shape, path
    assert linen_params[path].dtype == nnx_params[path].dtype, path


def test_logical_specs_equal(tiny_sides):
  linen, nnx_side = tiny_sides
  specs.check_no_drift(
      specs.linen_logical_specs(linen.abstract_variables),
      specs.nnx_logical_specs(nnx_side.abstract_params),
      'logical',
  )


def test_distributions_agree(native):
  linen_params, nnx_params = native
  checked = 0
  for path in sorted(linen_params):
    a = np.asarray(linen_params[path], np.float64).ravel()
    b = np.asarray(nnx_params[path], np.float64).ravel()
    if path.endswith('scale'):
      assert_bitwise_equal(linen_params[path], nnx_params[path], path)  # ones on both sides: bits, dtype, shape
      continue
    n = a.size
    s = max(a.std(), b.std())
    assert abs(a.mean() - b.mean()) <= 6 * s * math.sqrt(2 / n), path
    assert abs(a.std() / b.std() - 1) <= 6 / math.sqrt(n), path
    # Different keys: a side that copied the other's values is not "native".
    assert not np.array_equal(a, b), path
    checked += 1
  assert checked >= 8


def test_expected_init_scales(native):
  """Embedding ~ N(0, 1); fan-in truncated normal kernels have std 1/sqrt(fan_in)."""
  linen_params, _ = native
  emb = np.asarray(linen_params['token_embedder/embedding'])
  assert abs(emb.std() - 1.0) < 0.05
  wi = np.asarray(linen_params['decoder/layers/mlp/wi_0/kernel'])
  assert abs(wi.std() * math.sqrt(wi.shape[0]) - 1.0) < 0.05
