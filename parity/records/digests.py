"""How a record keeps an array: a digest of its dtype, shape and raw bits, or, for a scalar, its
bits in hex (read as a number too). One line per leaf, so that records diff as text."""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

import jax
import numpy as np

from parity.core import bitwise
from parity.core import paths
from parity.procs import distributed


def _host(x: Any) -> np.ndarray:
  """The array whole on this host (a typed key: its key data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    x = jax.random.key_data(x)
  return np.asarray(distributed.host_arrays({'x': x})['x'])


def kind(x: Any) -> str:
  """`dtype[shape]`, the array's type as every line shows it."""
  return paths.describe(x)


def digest(x: Any) -> str:
  """sha256 of the array's dtype, shape and raw bits (a typed key: its key data), 32 hex digits."""
  arr = _host(x)
  h = hashlib.sha256(f'{kind(x)};'.encode())
  h.update(bitwise.raw_bits(arr).tobytes())
  return h.hexdigest()[:32]


def scalar_bits(x: Any) -> str:
  """A scalar's raw bits in hex, and its value, as a line shows it (`0x3f800000 (1.0)`)."""
  arr = _host(x)
  bits = bitwise.raw_bits(arr).reshape(-1)
  return f'0x{int(bits[0]):0{2 * arr.dtype.itemsize}x} ({arr.reshape(-1)[0]})'


def value(x: Any) -> str:
  """What a record keeps of an array: its bits where it is a scalar, else its digest."""
  return scalar_bits(x) if np.size(x) == 1 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else digest(x)


def lines(prefix: str, flat: Mapping[str, Any]) -> list[str]:
  """`prefix path dtype[shape] value`, one per leaf of `flat`, sorted by path."""
  return [f'{prefix}{path}\t{kind(x)}\t{value(x)}' for path, x in sorted(paths.flatten(flat).items())]
