"""Arrays streamed box by box: box shapes, the Orbax item writer, JSON metadata and progress."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from parity.store.pair_convert.atomic import ConvertError

METADATA = '_METADATA'
CHECKPOINT_METADATA = '_CHECKPOINT_METADATA'
PYTREE_HANDLER = 'orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler'
# An array whose stored chunk is at most this big is re-encoded chunk for chunk; larger ones are
# split into boxes of BOX_BYTES.
ALIGNED_CHUNK_BYTES = 256 * 2**20
BOX_BYTES = 64 * 2**20
MAX_WRITES_IN_FLIGHT = 2


def _read_json(path: str, what: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ConvertError(f'not an Orbax checkpoint: {what} {path} is missing') from None
  except (OSError, ValueError) as e:
    raise ConvertError(f'{what} {path} is unreadable or corrupted: {e}') from None


def _write_json(path: str, value: Any) -> None:
  with open(path, 'w') as f:
    json.dump(value, f)


def _ocdbt_spec(item_dir: str, *, write: bool) -> dict[str, Any]:
  spec: dict[str, Any] = {'driver': 'ocdbt', 'base': f'file://{os.path.abspath(item_dir)}/'}
  if write:
    # As Orbax writes it (orbax tensorstore_utils._add_ocdbt_write_options).
    spec['config'] = {'max_inline_value_bytes': 1024, 'max_decoded_node_bytes': 100_000_000}
    spec['target_data_file_size'] = 2**31
  return spec


def box_shape(shape: Sequence[int], itemsize: int, budget: int | None = None) -> tuple[int, ...]:
  """A box of whole trailing axes, leading ones split to fit `budget` bytes (default BOX_BYTES)."""
  budget = BOX_BYTES if budget is None else budget
  shape = tuple(shape)
  for k in range(len(shape)):
    inner = math.prod(shape[k + 1:]) * itemsize
    if inner <= budget:
      return (1,) * k + (max(1, min(shape[k], budget // max(inner, 1))),) + shape[k + 1:]
  return shape  # a scalar


def _boxes(shape: Sequence[int], box: Sequence[int]) -> Iterator[tuple[slice, ...]]:
  """The boxes of shape `box` that tile an array of `shape`, in C order (the last ones clipped)."""
  ranges = [range(0, n, b) for n, b in zip(shape, box)]
  for starts in itertools.product(*ranges):
    yield tuple(slice(s, min(s + b, n)) for s, b, n in zip(starts, box, shape))


def _exact_cast(path: str, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  info = np.iinfo(dtype)
  if x.size and (x.min() < info.min or x.max() > info.max):
    raise ConvertError(f'{path}: value {x.min()}..{x.max()} does not fit {dtype.name}')
  return x.astype(dtype)


def _zarr3_metadata(shape, dtype: np.dtype, chunk: Sequence[int]) -> dict[str, Any]:
  """As Orbax writes it (orbax tensorstore_utils._build_zarr3_metadata), plus a
  zstd checksum: Orbax's frames have none, so a flipped bit in array data
  goes unnoticed there; here it is caught on read."""
  return {
      'shape': list(shape),
      'data_type': dtype.name,
      'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': list(chunk)}},
      'codecs': [{
          'name': 'sharding_indexed',
          'configuration': {
              'chunk_shape': list(chunk),
              'codecs': [
                  {'name': 'bytes', 'configuration': {'endian': 'little'}},
                  {'name': 'zstd', 'configuration': {'level': 3, 'checksum': True}},
              ],
              'index_codecs': [
                  {'name': 'bytes', 'configuration': {'endian': 'little'}},
                  {'name': 'crc32c'},
              ],
              'index_location': 'end',
          },
      }],
  }


@dataclasses.dataclass
class Progress:
  """How far a conversion is: arrays and decoded bytes written of the totals."""

  arrays_total: int
  bytes_total: int
  arrays_done: int = 0
  bytes_done: int = 0


def tty_progress(stream) -> Callable[[Progress], None]:
  """A progress line on a terminal, redrawn at most ten times a second (and at the end)."""
  shown = [0.0]

  def show(p: Progress) -> None:
    now = time.monotonic()
    if now - shown[0] < 0.1 and p.arrays_done < p.arrays_total:
      return
    shown[0] = now
    stream.write(
        f'\r  {p.arrays_done}/{p.arrays_total} arrays,'
        f' {p.bytes_done / 2**30:.2f}/{p.bytes_total / 2**30:.2f} GiB'
    )
    if p.arrays_done == p.arrays_total:
      stream.write('\n')
    stream.flush()

  return show


class ItemWriter:
  """Writes arrays box by box into a new Orbax PyTree item directory (OCDBT + zarr3).

  Each `write` gets whole destination chunks, so nothing is read back and
  rewritten; encoding runs in tensorstore's threads, overlapping the
  caller's next read, with at most MAX_WRITES_IN_FLIGHT boxes pending.
  """

  def __init__(self, item_dir: str):
    import tensorstore as ts

    self.item_dir = item_dir
    os.makedirs(item_dir, exist_ok=True)
    self._context = ts.Context({'cache_pool': {'total_bytes_limit': 0}})
    # One context: the zarr3 stores and this handle share one OCDBT writer.
    self._kv = ts.KvStore.open(_ocdbt_spec(item_dir, write=True), context=self._context).result()
    self._writes: collections.deque = collections.deque()
    self.tree_metadata: dict[str, Any] = {}

  def write(
      self, path: str, shape: Sequence[int], dtype: np.dtype, chunk: Sequence[int],
      boxes: Iterator[tuple[tuple[slice, ...], np.ndarray]],
      value_metadata: Mapping[str, Any] | None = None,
  ) -> None:
    """Writes array `path` from `(box, data)` pairs that cover its chunk grid."""
    import tensorstore as ts

    store = ts.open(
        {
            'driver': 'zarr3',
            'kvstore': {**_ocdbt_spec(self.item_dir, write=True), 'path': path.replace('/', '.') + '/'},
            'metadata': _zarr3_metadata(shape, np.dtype(dtype), chunk),
            # Orbax restores with fill_missing_data_reads off: every chunk must exist.
            'store_data_equal_to_fill_value': True,
        },
        create=True, context=self._context,
    ).result()
    for box, data in boxes:
      self._pending(store[box].write(data))
    self._add_metadata(path, chunk, value_metadata)

  def copy(
      self, path: str, src_kv, src_name: str, chunk: Sequence[int],
      value_metadata: Mapping[str, Any] | None = None,
  ) -> None:
    """Writes array `path` as a byte copy of array `src_name` of the OCDBT `src_kv`."""
    import tensorstore as ts

    prefix = src_name + '/'
    new_prefix = path.replace('/', '.') + '/'
    keys = src_kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + '0')).result()
    for key in keys:
      value = src_kv.read(key).result().value
      self._pending(self._kv.write(new_prefix + key.decode()[len(prefix):], value))
    self._add_metadata(path, chunk, value_metadata)

  def _pending(self, future) -> None:
    self._writes.append(future)
    while len(self._writes) > MAX_WRITES_IN_FLIGHT:
      self._writes.popleft().result()

  def _add_metadata(self, path: str, chunk: Sequence[int], value_metadata: Mapping[str, Any] | None) -> None:
    keys = path.split('/')
    value = dict(value_metadata or {'value_type': 'jax.Array', 'skip_deserialize': False})
    value['write_shape'] = list(chunk)
    self.tree_metadata[str(tuple(keys))] = {
        'key_metadata': [{'key': k, 'key_type': 2} for k in keys],
        'value_metadata': value,
    }

  def finish(self, metadata: Mapping[str, Any] | None = None) -> None:
    """Waits for every write, then writes `_METADATA` (`metadata` gives its other fields)."""
    while self._writes:
      self._writes.popleft().result()
    out = {'store_array_data_equal_to_fill_value': True, 'custom_metadata': None, **(metadata or {})}
    out.update(tree_metadata=dict(sorted(self.tree_metadata.items())), use_ocdbt=True, use_zarr3=True)
    _write_json(os.path.join(self.item_dir, METADATA), out)

  def abandon(self) -> None:
    """On an error or a signal: pending writes end before their directory is removed."""
    for future in self._writes:
      try:
        future.result()
      except BaseException:  # already failing; the first error is the one reported
        pass
    self._writes.clear()


def write_step_metadata(step_dir: str, items: Sequence[str], custom: Mapping[str, Any] | None = None,
                        base: Mapping[str, Any] | None = None) -> None:
  """`_CHECKPOINT_METADATA` of a step whose items are all Orbax PyTrees."""
  metadata = dict(base) if isinstance(base, Mapping) else {
      'item_handlers': {name: PYTREE_HANDLER for name in items},
      'metrics': {}, 'performance_metrics': {}, 'init_timestamp_nsecs': time.time_ns(),
  }
  merged = metadata.get('custom_metadata')
  merged = dict(merged) if isinstance(merged, Mapping) else {}
  merged.update(custom or {})
  metadata['custom_metadata'] = merged
  metadata['commit_timestamp_nsecs'] = time.time_ns()
  _write_json(os.path.join(step_dir, CHECKPOINT_METADATA), metadata)
