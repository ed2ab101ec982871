"""Train-state conventions every pair shares: the step counter's dtype on each side, and optimizer leaves that mirror a parameter.

The step counter is the one leaf whose dtype differs by design (Linen's
TrainState int32, `nnx.Optimizer` uint32); `convert_step` converts it exactly
and range-checks it.
"""
from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from parity.core import paths
from parity.core.errors import Problem, TreeMismatchError

LINEN_STEP_DTYPE = np.int32
NNX_STEP_DTYPE = np.uint32


def param_suffix(path: str, param_paths: Iterable[str]) -> str | None:
  """The parameter path that `path` ends with (an optimizer leaf mirroring it).

  The longest one: where one parameter's path ends with another's
  (`enc/head/kernel` and `head/kernel`), the mirror of the longer one ends
  with both, and the answer must not depend on the order of `param_paths`.
  """
  return max((p for p in param_paths if path.endswith('/' + p)), key=len, default=None)


def convert_step(value: Any, dtype: Any) -> Any:
  """The step counter in `dtype`, exactly; stays on its device (and sharding)."""
  if not hasattr(value, 'shape'):
    value = np.asarray(value)
  if value.shape != () or not np.issubdtype(np.dtype(value.dtype), np.integer):
    raise TreeMismatchError(
        'train state step', [Problem('step', 'dtype', 'an integer scalar', paths.describe(value))]
    )
  if isinstance(value, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((), dtype, sharding=value.sharding)
  if not 0 <= int(value) <= np.iinfo(np.int32).max:
    raise TreeMismatchError(
        'train state step', [Problem('step', 'value', '0 <= step < 2**31', str(int(value)))]
    )
  if isinstance(value, jax.Array):
    if value.dtype == dtype:
      return value
    # Read above already: put back where it was, with no XLA program for the conversion (on one
    # device, left uncommitted as an eager conversion's result is: a committed argument would
    # carry a sharding into the program that takes it).
    converted = np.asarray(int(value), dtype)
    if isinstance(value.sharding, jax.sharding.NamedSharding):
      return jax.device_put(converted, value.sharding)
    return jax.device_put(converted)  # uncommitted, and no `jit_stage` program as jnp.asarray's
  return jnp.asarray(value, dtype)
