"""Native NNX init against native Linen init: what is specific to the decoder.

The two frameworks derive init keys differently, so values differ; structure
(paths, shapes, dtypes, logical specs) must be identical. That every
parameter's distribution agrees (within 6 standard errors), and that what is
not random is bitwise, is the plugin's `test_init` part, run on every
scenario's pair (tests/test_decoder_pairs.py, parity/battery/checks/init.py `check_init`).
Here: the values really are each side's own, and the decoder's intended scales.
"""
import math

import numpy as np
import pytest

from parity.core import paths
from parity.core import specs
from tests import tiers

pytestmark = pytest.mark.xdist_group(tiers.TINY_PRESET_GROUP)  # the tiny preset's inits, compiled once


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


def test_random_values_are_each_sides_own(native):
  """Different keys: a side that copied the other's values would pass `test_init` without
  initialising anything itself. The norm scales are ones on both sides (bitwise in `test_init`)."""
  linen_params, nnx_params = native
  random = [path for path in sorted(linen_params) if not path.endswith('scale')]
  assert len(random) >= 8
  for path in random:
    assert not np.array_equal(np.asarray(linen_params[path]), np.asarray(nnx_params[path])), path


def test_expected_init_scales(native):
  """Embedding ~ N(0, 1); fan-in truncated normal kernels have std 1/sqrt(fan_in)."""
  linen_params, _ = native
  emb = np.asarray(linen_params['token_embedder/embedding'])
  assert abs(emb.std() - 1.0) < 0.05
  wi = np.asarray(linen_params['decoder/layers/mlp/wi_0/kernel'])
  assert abs(wi.std() * math.sqrt(wi.shape[0]) - 1.0) < 0.05
