"""Two checkpoints of a pair compared leaf by leaf, a box pair at a time (`compare_checkpoints`)."""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
from typing import Any, Iterator, Sequence

import numpy as np

import parity.store.pair_convert.streaming as streaming
from parity.store.pair_convert.atomic import ConvertError
from parity.store.pair_convert.layouts import Layout, Leaf, SHARDING, pair_layouts
from parity.store.pair_convert.reading import Item, Stored, _integer_scalar, _store_spec, _unreadable, identify, locate
from parity.store.pair_convert.restore import pair_sides


@dataclasses.dataclass
class CheckpointDiff:
  """Two checkpoints compared leaf by leaf through the pair's correspondences."""

  a: str
  b: str
  a_format: str
  b_format: str
  compared: int
  differences: list[str]  # one line per leaf, named on both sides
  kinds: dict[str, int]
  not_compared: list[str]  # state only NNX keeps, where one checkpoint is Linen's

  @property
  def equal(self) -> bool:
    """Every leaf compared, bit for bit."""
    return not self.differences

  def summary(self) -> str:
    """One line: what was compared, and the verdict."""
    kinds = ', '.join(f'{n} {k}' for k, n in sorted(self.kinds.items()))
    shown = ', '.join(self.not_compared[:3]) + (', ...' if len(self.not_compared) > 3 else '')
    skipped = (f'; {len(self.not_compared)} leaves one-sided, state only the NNX side keeps, which the Linen'
               f' side has no place for ({shown}): not compared' if self.not_compared else '')
    verdict = 'EQUAL (bit for bit)' if self.equal else (
        f'DIFFERENT: {len(self.differences)} difference{"s" if len(self.differences) != 1 else ""} ({kinds})')
    return (f'A {self.a} ({self.a_format}) vs B {self.b} ({self.b_format}): {self.compared} leaves'
            f' compared{skipped}: {verdict}')

  def report(self, limit: int | None = None) -> str:
    """Each differing leaf (at most `limit`), then the summary."""
    lines = self.differences if limit is None else self.differences[:limit]
    more = [] if limit is None or len(self.differences) <= limit else [
        f'  ... and {len(self.differences) - limit} more']
    return '\n'.join([f'  {line}' for line in lines] + more + [self.summary()])


# A diff reads two arrays a box pair at a time: each box at most this many bytes (a stored chunk,
# split where larger), so its memory is about one chunk pair, never two whole arrays.
DIFF_BOX_BYTES = streaming.BOX_BYTES


def _chunk_bytes(stored: Stored) -> int:
  return math.prod(stored.chunk) * stored.dtype.itemsize


def _diff_boxes(shape: Sequence[int], chunk: Sequence[int], itemsize: int) -> Iterator[tuple[slice, ...]]:
  """The boxes a diff reads an array in: its stored chunks in C order, each split into boxes of at
  most DIFF_BOX_BYTES (whole trailing axes, leading ones split) where larger."""
  chunk = tuple(max(1, int(c)) for c in chunk)
  if math.prod(chunk) * itemsize <= DIFF_BOX_BYTES:
    yield from streaming._boxes(shape, chunk)
    return
  for outer in streaming._boxes(shape, chunk):
    extent = [s.stop - s.start for s in outer]
    for inner in streaming._boxes(extent, streaming.box_shape(extent, itemsize, DIFF_BOX_BYTES)):
      yield tuple(slice(o.start + i.start, o.start + i.stop) for o, i in zip(outer, inner))


def _open_array(item: Item, stored: Stored, cache_bytes: int = 0):
  """One array of a checkpoint, opened for reading (`cache_bytes`: decoded chunks kept for boxes
  that read a chunk in parts)."""
  import tensorstore as ts

  context = ts.Context({'cache_pool': {'total_bytes_limit': cache_bytes}})
  try:
    return ts.open(_store_spec(item.item_dir, stored.name, stored.zarr3, stored.ocdbt), read=True, open=True,
                   context=context).result()
  except Exception as e:  # tensorstore raises ValueError and others
    raise ConvertError(_unreadable(stored.disk, item.item_dir, e)) from None


def _read_pair(items: Sequence[Item], stored: Sequence[Stored], stores: Sequence[Any],
               box: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
  """One box of each of two arrays, read concurrently (all a diff holds of them at a time)."""
  futures = [store[box].read() for store in stores]
  out = []
  for item, one, future in zip(items, stored, futures):
    try:
      out.append(future.result())
    except Exception as e:  # tensorstore raises ValueError and others
      raise ConvertError(_unreadable(one.disk, item.item_dir, e)) from None
  return out[0], out[1]


def _compare_arrays(items: Sequence[Item], sa: Stored, sb: Stored, cast: bool) -> str | None:
  """What `bitwise.compare_leaves` says of two arrays of one shape (None: bit for bit), read box by
  box along A's stored chunks (B's where smaller); `cast`: both compared as int64 (the step)."""
  from parity.core import bitwise

  grid = sb.chunk if sb.chunk != sa.chunk and _chunk_bytes(sb) < _chunk_bytes(sa) else sa.chunk

  def cache(stored):  # a chunk read in parts is decoded once, where it is small enough to keep
    split = tuple(stored.chunk) != tuple(grid) or _chunk_bytes(stored) > DIFF_BOX_BYTES
    return _chunk_bytes(stored) if split and _chunk_bytes(stored) <= streaming.ALIGNED_CHUNK_BYTES else 0

  stores = [_open_array(item, one, cache(one)) for item, one in zip(items, (sa, sb))]
  tally = bitwise.BitsTally(sa.shape, np.int64 if cast else sa.dtype)
  for box in _diff_boxes(sa.shape, grid, max(sa.dtype.itemsize, sb.dtype.itemsize)):
    xa, xb = _read_pair(items, (sa, sb), stores, box)
    if cast:
      xa, xb = xa.astype(np.int64), xb.astype(np.int64)
    tally.add(tuple(b.start for b in box), xa, xb)
  return None if tally.equal else tally.detail()


def _shardings(item: Item) -> dict[str, Any]:
  """Each array's sharding as the checkpoint records it (`_sharding`), by Orbax parameter name."""
  path = os.path.join(item.item_dir, SHARDING)
  if not os.path.exists(path):
    return {}
  raw = streaming._read_json(path, 'Orbax sharding metadata')
  out = {}
  for key, value in raw.items():
    try:
      out[base64.urlsafe_b64decode(key.encode()).decode()] = json.loads(value)
    except (ValueError, TypeError):
      continue
  return out


def compare_checkpoints(
    pair: Any, a: str | os.PathLike, b: str | os.PathLike, *, step_a: int | None = None,
    step_b: int | None = None, item: str | None = None, sides: Sequence[Any] | None = None,
) -> CheckpointDiff:
  """Compares two checkpoints of the pair, of one side or of both, leaf by leaf through its
  correspondences: structure, shapes, dtypes, shardings and values (bitwise; ULP where floats differ).

  Each must be one side's own checkpoint (any of FORMATS); leaves one lacks, or of another shape or
  dtype, are differences. The step's dtype (int32 on Linen, uint32 on NNX) differs by design: its
  values are compared. Arrays are read a box pair at a time (stored chunks, at most DIFF_BOX_BYTES
  each), so memory stays about one chunk pair, never two whole arrays. Raises ConvertError or
  TreeMismatchError when a checkpoint is not one.
  """
  sides = tuple(sides) if sides is not None else pair_sides(pair, None)
  layouts = pair_layouts(sides, getattr(pair, 'saves', None))
  items = [locate(path, label, step, item, layouts) for path, label, step in ((a, 'A', step_a), (b, 'B', step_b))]
  (la, _), (lb, _) = [identify(it, layouts, pair.name, exact=False) for it in items]
  same_role = la.role == lb.role
  # Every leaf by its checkpoint path, or, for state only NNX keeps, its native path (compared when both are NNX).
  def keyed(layout: Layout, it: Item) -> dict[str, tuple[Leaf, Stored | None]]:
    out = {}
    for leaf in layout.leaves:
      key = leaf.checkpoint if leaf.checkpoint is not None else f'nnx-only/{leaf.native}'
      out[key] = (leaf, it.arrays.get(leaf.disk))
    return out

  ka, kb = keyed(la, items[0]), keyed(lb, items[1])
  labels = (f'A {la.format}', f'B {lb.format}')
  lines, kinds, not_compared, compared = [], {}, [], 0

  def name(key):
    return ' | '.join(f'{label}: {k[key][0].disk}' if key in k else f'{label}: -'
                      for label, k in zip(labels, (ka, kb)))

  def differ(key, kind, detail, named=True):
    kinds[kind] = kinds.get(kind, 0) + 1
    lines.append(f'{key} [{name(key)}]: {kind}: {detail}' if named else f'{key}: {kind}: {detail}')

  for label, layout, it in zip(('A', 'B'), (la, lb), items):
    for disk in sorted(set(it.arrays) - set(layout.by_disk())):
      differ(f'{label} {disk}', 'extra', f'no leaf of the pair\'s {layout.role} state ({layout.format})',
             named=False)
  for key in sorted(set(ka) | set(kb)):
    if key.startswith('nnx-only/') and not same_role:
      leaf, _ = ka.get(key) or kb.get(key)
      not_compared.append(leaf.disk)
      continue
    left, right = ka.get(key), kb.get(key)
    held = [side is not None and side[1] is not None for side in (left, right)]
    if not all(held):
      differ(key, 'missing', f'only in {"A" if held[0] else "B"}' if any(held) else 'in neither')
      continue
    compared += 1
    (_, sa), (_, sb) = left, right
    if sa.shape != sb.shape:
      differ(key, 'shape', f'{list(sa.shape)} vs {list(sb.shape)}')
      continue
    cast = ''
    if sa.dtype != sb.dtype:
      if key == 'step' and _integer_scalar(sa.shape, sa.dtype) and _integer_scalar(sb.shape, sb.dtype):
        cast = f'{sa.dtype.name} vs {sb.dtype.name} by design, compared as integers: '
      else:
        differ(key, 'dtype', f'{sa.dtype.name} vs {sb.dtype.name}')
        continue
    detail = _compare_arrays(items, sa, sb, bool(cast))
    if detail is not None:
      differ(key, 'values', cast + detail)
  # Placement: each leaf's recorded sharding (only between two checkpoints that record them).
  sh = [_shardings(it) for it in items]
  if sh[0] and sh[1]:
    for key in sorted(set(ka) & set(kb)):
      (_, sa), (_, sb) = ka[key], kb[key]
      if sa is None or sb is None:
        continue
      ea, eb = sh[0].get(sa.name), sh[1].get(sb.name)
      if ea != eb:
        differ(key, 'sharding', f'{ea} vs {eb}')
  lines.sort()
  return CheckpointDiff(items[0].describe(), items[1].describe(), la.format, lb.format, compared, lines, kinds,
                        not_compared)
