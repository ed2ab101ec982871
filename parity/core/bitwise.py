"""Bitwise pytree comparison: the helper every equivalence test uses.

Two leaves are equal when shape, dtype and raw bits (the array viewed as
unsigned integers) are equal: NaN payloads count, and -0.0 differs from
+0.0. A typed PRNG key array (`jax.random.key`, NNX's `RngKey`) is equal
when its key type and shape are and its key data is bit for bit.
`np.testing.assert_array_equal` and `chex.assert_trees_all_equal`
compare values, not bits, so they are not used for equivalence.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from parity.core import paths

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def raw_bits(x: Any) -> np.ndarray:
  """The array's bytes as unsigned integers of the same width."""
  arr = np.asarray(x)
  if arr.dtype == np.bool_:
    return arr.view(np.uint8)
  return arr.view(_UINT[arr.dtype.itemsize])


@dataclasses.dataclass(frozen=True)
class LeafDiff:
  """One leaf that is not bit-identical, with enough detail to act on."""

  path: str
  kind: str  # 'missing', 'extra', 'shape', 'dtype' or 'bits'
  detail: str

  def __str__(self) -> str:
    return f'{self.path}: {self.kind}: {self.detail}'


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
  """Float bit patterns mapped to integers whose order is the float order."""
  sign = bits >> (8 * width - 1)
  magnitude = (bits & ~(np.array(1, bits.dtype) << (8 * width - 1))).astype(object if width == 8 else np.int64)
  return np.where(sign == 1, -magnitude, magnitude)


# Elements a tally folds in at a time: its temporaries (float64 values, ordered bits) stay a few tens of MiB.
_PIECE = 1 << 20


class BitsTally:
  """What `compare_leaves` says of two arrays' bits, folded in box by box.

  `add(start, a, b)` takes the two arrays' boxes at index `start` (any boxes, in any order); `detail()`
  is then the detail `compare_leaves` gives for the whole arrays, character for character: count,
  max abs diff, max ULP distance (floats), elements of opposite sign, and the first differing element
  in C order. So two arrays too large to hold compare a box pair at a time
  (parity.store.pair_convert.compare_checkpoints).
  """

  def __init__(self, shape, dtype):
    self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
    self.count = 0
    self.first: tuple | None = None  # (index, value a, value b, bits a, bits b)
    self.max_abs = None  # floats: the largest finite |a - b| (None: none finite); integers: the largest |a - b|
    self.max_ulp = 0
    self.opposite = 0

  @property
  def equal(self) -> bool:
    """No element folded in so far differs."""
    return not self.count

  def add(self, start, a, b) -> None:
    """Folds in the two arrays' boxes of one shape whose first element is at index `start`."""
    a, b = np.asarray(a), np.asarray(b)
    bits_a, bits_b = raw_bits(a).reshape(-1), raw_bits(b).reshape(-1)
    if np.array_equal(bits_a, bits_b):
      return
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    for lo in range(0, bits_a.size, _PIECE):
      hi = lo + _PIECE
      self._piece(tuple(start), a.shape, lo, flat_a[lo:hi], flat_b[lo:hi], bits_a[lo:hi], bits_b[lo:hi])

  def _piece(self, start, box, lo, a, b, bits_a, bits_b) -> None:
    differ = bits_a != bits_b
    count = int(np.count_nonzero(differ))
    if not count:
      return
    self.count += count
    k = int(np.argmax(differ))  # the first differing element, in the box's C order
    local = np.unravel_index(lo + k, box) if box else ()
    index = tuple(int(s) + int(i) for s, i in zip(start, local))
    if self.first is None or index < self.first[0]:
      self.first = (index, a[k], b[k], int(bits_a[k]), int(bits_b[k]))
    if _is_float(self.dtype):
      fa, fb = a[differ].astype(np.float64), b[differ].astype(np.float64)
      with np.errstate(invalid='ignore'):
        absdiff = np.abs(fa - fb)
      finite = absdiff[np.isfinite(absdiff)]
      if finite.size:
        self.max_abs = finite.max() if self.max_abs is None else max(self.max_abs, finite.max())
      width = self.dtype.itemsize
      ulps = np.abs(_ordered(bits_a[differ], width) - _ordered(bits_b[differ], width))
      self.max_ulp = max(self.max_ulp, int(ulps.max()))
      sign = 8 * width - 1
      self.opposite += int(np.count_nonzero((bits_a[differ] >> sign) != (bits_b[differ] >> sign)))
    elif np.issubdtype(self.dtype, np.integer):
      wide = np.int64 if self.dtype.itemsize < 8 else object  # exact either way
      largest = int(np.max(np.abs(a[differ].astype(wide) - b[differ].astype(wide))))
      self.max_abs = largest if self.max_abs is None else max(self.max_abs, largest)

  def detail(self) -> str:
    """`compare_leaves`'s detail of the whole arrays (only where some element differs)."""
    if self.first is None:
      raise ValueError('no element differs: there is no detail to give')
    index, va, vb, ba, bb = self.first
    parts = [f'{self.count} of {math.prod(self.shape)} elements differ']
    if _is_float(self.dtype):
      parts.append(f'max abs diff {self.max_abs if self.max_abs is not None else float("nan"):.6g}')
      parts.append(f'max ULP distance {self.max_ulp}')
      if self.opposite:  # float32 -1e-30 against +1e-30 is 457,475,264 ULP apart; -0.0 against +0.0 is 0
        parts.append(f'{self.opposite} of them of opposite sign (a ULP distance across zero counts'
                     ' every float between: read the max abs diff)')
    elif np.issubdtype(self.dtype, np.integer):
      parts.append(f'max abs diff {self.max_abs}')
    parts.append(f'first at index {list(index)}: {va!r} (bits 0x{ba:x}) vs {vb!r} (bits 0x{bb:x})')
    return f'{self.dtype.name}{list(self.shape)}: ' + ', '.join(parts)


def _is_float(dtype: np.dtype) -> bool:
  """numpy floats and ml_dtypes floats (bfloat16, float8_*), which numpy does not call inexact."""
  return np.issubdtype(dtype, np.inexact) or 'float' in dtype.name


def _typed_key(x: Any) -> bool:
  dtype = getattr(x, 'dtype', None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def compare_leaves(path: str, a: Any, b: Any) -> LeafDiff | None:
  if _typed_key(a) or _typed_key(b):  # numpy cannot hold them: their key data is compared
    if np.shape(a) != np.shape(b):
      return LeafDiff(path, 'shape', f'{list(np.shape(a))} vs {list(np.shape(b))}')
    if paths.dtype_name(a.dtype) != paths.dtype_name(b.dtype):
      return LeafDiff(path, 'dtype', f'{paths.dtype_name(a.dtype)} vs {paths.dtype_name(b.dtype)}')
    diff = compare_leaves(path, jax.random.key_data(a), jax.random.key_data(b))
    return None if diff is None else LeafDiff(path, diff.kind, f'{paths.dtype_name(a.dtype)} key data {diff.detail}')
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape:
    return LeafDiff(path, 'shape', f'{list(a.shape)} vs {list(b.shape)}')
  if a.dtype != b.dtype:
    return LeafDiff(path, 'dtype', f'{a.dtype.name} vs {b.dtype.name}')
  bits_a, bits_b = raw_bits(a), raw_bits(b)
  if np.array_equal(bits_a, bits_b):
    return None
  tally = BitsTally(a.shape, a.dtype)
  tally.add((0,) * a.ndim, a, b)
  return LeafDiff(path, 'bits', tally.detail())


def compare_trees(a: Any, b: Any, labels: tuple[str, str] = ('the first tree', 'the second tree')) -> list[LeafDiff]:
  """Every leaf of `a` and `b` that is not bit-identical (empty list: equal); `labels` name
  the two trees where a path is in one only."""
  flat_a, flat_b = paths.flatten(a), paths.flatten(b)
  diffs = [LeafDiff(p, 'missing', f'only in {labels[0]}') for p in sorted(set(flat_a) - set(flat_b))]
  diffs += [LeafDiff(p, 'extra', f'only in {labels[1]}') for p in sorted(set(flat_b) - set(flat_a))]
  for path in sorted(set(flat_a) & set(flat_b)):
    diff = compare_leaves(path, flat_a[path], flat_b[path])
    if diff is not None:
      diffs.append(diff)
  return diffs


def bitwise_equal(a: Any, b: Any) -> bool:
  return not compare_trees(a, b)


def assert_bitwise_equal(a: Any, b: Any, what: str = 'trees') -> None:
  """Raises AssertionError listing every differing leaf of `a` vs `b`."""
  __tracebackhide__ = True  # pytest shows the caller's line and this message, not this frame
  diffs = compare_trees(a, b)
  if diffs:
    lines = [f'{what} are not bit-identical: {len(diffs)} leaf/leaves differ']
    lines += [f'  {d}' for d in diffs[:50]]
    if len(diffs) > 50:
      lines.append(f'  ... and {len(diffs) - 50} more')
    raise AssertionError('\n'.join(lines))


def max_ulp(a: Any, b: Any) -> int:
  """Largest distance in units in the last place between two float arrays of one shape and dtype."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype or not _is_float(a.dtype):
    raise ValueError(f'max_ulp needs two float arrays of one shape and dtype, got {paths.describe(a)} and {paths.describe(b)}')
  width = a.dtype.itemsize
  bits_a, bits_b = raw_bits(a), raw_bits(b)
  if not a.size:
    return 0
  return int(np.max(np.abs(_ordered(bits_a, width) - _ordered(bits_b, width))))


def ulp_distance(a: Any, b: Any) -> int | None:
  """`max_ulp(a, b)`, or None where ULPs mean nothing: shapes or dtypes differ, or not floats."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype or not _is_float(a.dtype):
    return None
  return max_ulp(a, b)


def digest(flat: Any) -> str:
  """sha256 over every leaf's path, dtype, shape and raw bits (a tree's identity, bit for bit)."""
  import hashlib

  h = hashlib.sha256()
  for path, x in sorted(paths.flatten(flat).items()):
    name = paths.dtype_name(x.dtype) if _typed_key(x) else None
    arr = np.asarray(jax.random.key_data(x)) if name else np.asarray(x)
    h.update(f'{path}:{name or arr.dtype.name}{list(np.shape(x))};'.encode())
    h.update(raw_bits(arr).tobytes())
  return h.hexdigest()
