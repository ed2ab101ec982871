"""Writing a conversion: each array streamed chunk by chunk, metadata as Orbax writes it."""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import shutil
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from parity.core.errors import Problem
from parity.core.errors import TreeMismatchError
import parity.store.pair_convert.streaming as streaming
from parity.store.pair_convert.atomic import ConvertError
from parity.store.pair_convert.layouts import CHECKPOINT_METADATA, COMMIT, Layout, Leaf, METADATA, SHARDING
from parity.store.pair_convert.reading import Item, Stored, _integer_scalar, _store_spec, _unreadable


class _Writer(streaming.ItemWriter):
  """The converter's item writer, with `_METADATA` in the order and with the key types Orbax writes;
  zarr (v2) arrays as Orbax writes them where the source is zarr, so its chunks copy as they are."""

  def __init__(self, item_dir: str, zarr3: bool = True):
    """A new item directory; `zarr3` False: zarr (v2) arrays."""
    super().__init__(item_dir)
    self.zarr3 = zarr3

  def write(self, path, shape, dtype, chunk, boxes, value_metadata=None) -> None:
    """As ItemWriter.write, in the item's array format."""
    if self.zarr3:
      return super().write(path, shape, dtype, chunk, boxes, value_metadata)
    import tensorstore as ts

    store = ts.open({
        'driver': 'zarr',
        'kvstore': {**streaming._ocdbt_spec(self.item_dir, write=True), 'path': path.replace('/', '.') + '/'},
        'metadata': {'shape': list(shape), 'chunks': list(chunk), 'dtype': np.dtype(dtype).str,
                     'compressor': {'id': 'zstd', 'level': 1}, 'fill_value': None, 'filters': None,
                     'order': 'C', 'dimension_separator': '.'},
    }, create=True, context=self._context).result()
    for box, data in boxes:
      self._pending(store[box].write(data))
    self._add_metadata(path, chunk, value_metadata)

  def finish_as(self, layout: Layout, base: Mapping[str, Any]) -> None:
    """Waits for every write, then writes `_METADATA` as Orbax would for `layout`'s tree."""
    while self._writes:
      self._writes.popleft().result()
    tree = {}
    entries = [(leaf.keys, self.tree_metadata[str(tuple(leaf.disk.split('/')))]['value_metadata'])
               for leaf in layout.leaves if str(tuple(leaf.disk.split('/'))) in self.tree_metadata]
    entries += [(keys, {'value_type': typestr, 'skip_deserialize': True}) for keys, typestr in layout.empties]
    # In the layout's flatten order, placeholders in place: Orbax rebuilds a sequence index by index.
    order = {keys: i for i, keys in enumerate(layout.order)}
    for keys, value in sorted(entries, key=lambda e: order[e[0]]):
      tree[str(tuple(k for k, _ in keys))] = {
          'key_metadata': [{'key': k, 'key_type': t} for k, t in keys], 'value_metadata': value}
    out = {k: v for k, v in base.items() if k not in ('tree_metadata', 'value_metadata_tree')}
    out.update(tree_metadata=tree, use_ocdbt=True, use_zarr3=self.zarr3, store_array_data_equal_to_fill_value=True)
    out.setdefault('custom_metadata', None)
    streaming._write_json(os.path.join(self.item_dir, METADATA), out)


@dataclasses.dataclass(frozen=True)
class _Job:
  """One array of the output: copied from a source array, or a value of `create(0)`."""

  target: Leaf
  source: Stored | None  # None: a value of `create(0)` (state only NNX keeps)
  value: np.ndarray | None = None
  key_impl: str | None = None  # a typed key's implementation (Orbax's `random_key_impl`)
  perm: tuple[int, ...] | None = None  # the target is source.transpose(perm) (an axis the sides store elsewhere)

  @property
  def nbytes(self) -> int:
    """The bytes it writes, decoded."""
    return math.prod(self.target.shape) * self.target.dtype.itemsize


def nnx_only_values(side: Any, layout: Layout) -> dict[str, tuple[np.ndarray, str | None]]:
  """The state only NNX keeps, as the side's `create(0)` makes it, by native path: (its data, a
  typed key's implementation). Jitted, so only that state is computed, not the model's parameters."""
  import jax
  from flax import nnx

  from parity.core import compat
  from parity.core import paths

  wanted = [leaf for leaf in layout.leaves if leaf.checkpoint is None]
  if not wanted:
    return {}
  only = tuple(getattr(side, 'nnx_only', ()) or ())
  if not only:
    raise ConvertError(f'the NNX side keeps {[l.native for l in wanted]} outside the checkpoint layout but'
                       ' declares no nnx_only types to make them from')

  def make():
    with compat.eager_sharding_off():
      return nnx.split(side.create(0), nnx.Any(*only), ...)[1]

  try:
    state = jax.jit(make)()
  except Exception:  # a `create` jit cannot trace: made eagerly
    state = make()
  flat = paths.flatten(state)
  out = {}
  for leaf in wanted:
    x, impl = flat[leaf.native], None
    if leaf.typed_key:
      x, impl = jax.random.key_data(x), str(jax.random.key_impl(x))
    out[leaf.native] = (np.asarray(x), impl)
  return out


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
  return tuple(int(i) for i in np.argsort(perm))


def _move(src: Leaf, target: Leaf, moves: Mapping[str, Mapping[str, tuple[int, ...]]],
          source_role: str, target_role: str) -> tuple[int, ...] | None:
  """The transpose taking `src` as stored to `target` (each side's axis moves against the pair's
  checkpoint layout, `layouts.axis_moves`), None where the sides store it alike."""
  to_ckpt = moves.get(source_role, {}).get(src.native)
  from_ckpt = moves.get(target_role, {}).get(target.native)
  if to_ckpt is None and from_ckpt is None:
    return None
  ndim = len(target.shape)
  to_ckpt = to_ckpt or tuple(range(ndim))
  return tuple(to_ckpt[i] for i in _inverse(from_ckpt or tuple(range(ndim))))


def _plan(source: Layout, item: Item, target: Layout, values: Mapping[str, tuple[np.ndarray, str | None]],
          moves: Mapping[str, Mapping[str, tuple[int, ...]]] | None = None) -> tuple[list[_Job], list[str]]:
  """(a job per target leaf, the source leaves the target has no place for: state only NNX keeps).

  `moves`: by role, the leaves each side stores with axes moved (`layouts.axis_moves`)."""
  by_checkpoint = source.by_checkpoint()
  jobs, problems = [], []
  for leaf in target.leaves:
    if leaf.checkpoint is None:
      jobs.append(_Job(leaf, None, *values[leaf.native]))
      continue
    src = by_checkpoint.get(leaf.checkpoint)
    if src is None:
      problems.append(Problem(leaf.checkpoint, 'missing', f'{target.role} {leaf.disk}',
                              f'no {source.role} leaf (the pair\'s sides differ in the checkpoint layout)'))
      continue
    stored = item.arrays[src.disk]
    perm = _move(src, leaf, moves or {}, source.role, target.role)
    if perm is not None and len(perm) == len(stored.shape) and tuple(stored.shape[a] for a in perm) == leaf.shape:
      if stored.dtype != leaf.dtype:
        problems.append(Problem(leaf.checkpoint, 'dtype', f'{target.role} {leaf.disk} {leaf.dtype.name}',
                                f'{source.role} {src.disk} {stored.dtype.name}'))
      else:
        jobs.append(_Job(leaf, stored, perm=perm))
    elif stored.shape != leaf.shape:
      problems.append(Problem(leaf.checkpoint, 'shape', f'{target.role} {leaf.disk} {list(leaf.shape)}',
                              f'{source.role} {src.disk} {list(stored.shape)}: the sides store it in other'
                              ' shapes, and the side\'s to_checkpoint does not move its axes (a transpose)'
                              ' to make one the other'))
    elif stored.dtype != leaf.dtype and not _integer_scalar(leaf.shape, leaf.dtype):
      problems.append(Problem(leaf.checkpoint, 'dtype', f'{target.role} {leaf.disk} {leaf.dtype.name}',
                              f'{source.role} {src.disk} {stored.dtype.name}'))
    else:
      jobs.append(_Job(leaf, stored))
  wanted = {leaf.checkpoint for leaf in target.leaves}
  for leaf in source.leaves:
    if leaf.checkpoint is not None and leaf.checkpoint not in wanted:
      problems.append(Problem(leaf.checkpoint, 'extra', 'nothing', f'{source.role} {leaf.disk}: the {target.role}'
                              ' side has no such leaf (the pair\'s sides differ in the checkpoint layout)'))
  if problems:
    raise TreeMismatchError(f'{source.role} -> {target.role} through the pair\'s correspondences', problems)
  dropped = [leaf.disk for leaf in source.leaves if leaf.checkpoint is None]
  return jobs, dropped


def _box_chunk(stored: Stored) -> tuple[int, ...]:
  """The chunk an array is re-encoded in: its own where small enough, else a box of BOX_BYTES."""
  if math.prod(stored.chunk) * stored.dtype.itemsize <= streaming.ALIGNED_CHUNK_BYTES:
    return stored.chunk
  return streaming.box_shape(stored.shape, stored.dtype.itemsize)


def _permuted_chunk(stored: Stored, perm: Sequence[int], itemsize: int) -> tuple[tuple[int, ...], int]:
  """(the chunk an axis-moved array is written in, bytes of the source's decoded chunks to cache):
  the image of a stored chunk where small enough (each written chunk then reads one stored chunk,
  decoded once), else boxes of BOX_BYTES with the source's chunks cached until its last box."""
  image = tuple(stored.chunk[a] for a in perm)
  if math.prod(image) * itemsize <= streaming.ALIGNED_CHUNK_BYTES:
    return image, 0
  return streaming.box_shape(tuple(stored.shape[a] for a in perm), itemsize), stored.nbytes


def _write_jobs(jobs: Sequence[_Job], item: Item, writer: _Writer, state: streaming.Progress | None = None,
                progress: Callable[[streaming.Progress], None] | None = None) -> None:
  """Every job's array: its encoded chunks copied (OCDBT, the writer's format, the same dtype), else read
  and written chunk by chunk (box by box where a chunk is large); `progress` told after each box."""
  import tensorstore as ts

  state = state or streaming.Progress(len(jobs), sum(j.nbytes for j in jobs))

  def advance(nbytes: int, array_done: bool = False) -> None:
    state.bytes_done += nbytes
    state.arrays_done += int(array_done)
    if progress is not None:
      progress(state)

  src_kv = None
  for job in jobs:
    leaf, stored = job.target, job.source
    path = leaf.disk
    value_metadata = {'value_type': 'jax.Array', 'skip_deserialize': False}
    if stored is None:
      data = job.value.astype(leaf.dtype, copy=False)
      box = tuple(slice(0, n) for n in data.shape)
      writer.write(path, data.shape, data.dtype, data.shape or (), iter([(box, data)]), value_metadata)
      advance(job.nbytes, True)
      continue
    chunk, cache = _box_chunk(stored), 0
    if job.perm is not None:
      chunk, cache = _permuted_chunk(stored, job.perm, leaf.dtype.itemsize)
    context = ts.Context({'cache_pool': {'total_bytes_limit': cache + cache // 8}})  # room for overhead
    store = ts.open(_store_spec(item.item_dir, stored.name, stored.zarr3, stored.ocdbt), read=True, open=True,
                    context=context).result()
    cast = stored.dtype != leaf.dtype
    if stored.zarr3 == writer.zarr3 and stored.ocdbt and not cast and job.perm is None:
      for box in streaming._boxes(stored.shape, stored.chunk):  # decoded once, to catch damage
        try:
          store[box].read().result()
        except Exception as e:  # tensorstore raises ValueError and others
          raise ConvertError(_unreadable(stored.disk, item.item_dir, e)) from None
      if src_kv is None:
        src_kv = ts.KvStore.open(streaming._ocdbt_spec(item.item_dir, write=False), context=ts.Context()).result()
      writer.copy(path, src_kv, stored.name, stored.chunk, value_metadata)
      advance(job.nbytes, True)
      continue

    def boxes(store=store, stored=stored, chunk=chunk, cast=cast, leaf=leaf, perm=job.perm):
      for box in streaming._boxes(leaf.shape, chunk):
        src_box = box
        if perm is not None:
          src_box = [None] * len(box)
          for dst_axis, src_axis in enumerate(perm):
            src_box[src_axis] = box[dst_axis]
          src_box = tuple(src_box)
        try:
          data = store[src_box].read().result()
        except Exception as e:  # tensorstore raises ValueError and others
          raise ConvertError(_unreadable(stored.disk, item.item_dir, e)) from None
        if perm is not None:
          data = np.transpose(data, perm)
        yield box, (streaming._exact_cast(f'{stored.disk} ({leaf.checkpoint})', data, leaf.dtype) if cast else data)
        advance(math.prod(b.stop - b.start for b in box) * leaf.dtype.itemsize)

    writer.write(path, leaf.shape, leaf.dtype, chunk, boxes(), value_metadata)
    advance(0, True)
    del store


def _sharding_entries(item: Item, jobs: Sequence[_Job]) -> dict[str, str] | None:
  """`_sharding` of the converted item: each source leaf's entry under its new name; state only
  NNX keeps, which has none, replicated where the source records a mesh."""
  path = os.path.join(item.item_dir, SHARDING)
  if not os.path.exists(path):
    return None
  src = streaming._read_json(path, 'Orbax sharding metadata')
  encode = lambda name: base64.urlsafe_b64encode(name.encode()).decode()
  out, fallback = {}, None
  for job in jobs:
    if job.source is not None and encode(job.source.name) in src:
      entry = src[encode(job.source.name)]
      if job.perm is not None:  # the partition spec moves with the axes
        parsed = json.loads(entry)
        spec = parsed.get('partition_spec')
        if isinstance(spec, list):
          spec = spec + [None] * (len(job.perm) - len(spec))
          entry = json.dumps({**parsed, 'partition_spec': [spec[a] for a in job.perm]})
      out[encode(job.target.disk.replace('/', '.'))] = entry
      if fallback is None:
        entry = json.loads(src[encode(job.source.name)])
        fallback = json.dumps({**entry, 'partition_spec': []} if 'partition_spec' in entry else entry)
  for job in jobs:
    if job.source is None and fallback is not None:
      out[encode(job.target.disk.replace('/', '.'))] = fallback
  return out


def _write_array_metadatas(out_dir: str, jobs: Sequence[_Job], writer: _Writer) -> None:
  """`array_metadatas/process_0` as Orbax writes it: each array's chunks, and a typed key's
  implementation, without which Orbax restores a key as its raw data."""
  entries = []
  for job in jobs:
    name = job.target.disk.replace('/', '.')
    written = writer.tree_metadata[str(tuple(job.target.disk.split('/')))]['value_metadata']
    chunk = list(written.get('write_shape', job.target.shape))
    ext = {'random_key_impl': job.key_impl} if job.key_impl else None
    entries.append({'array_metadata': {'param_name': name, 'write_shape': chunk, 'chunk_shape': chunk,
                                       'ext_metadata': ext}})
  os.makedirs(os.path.join(out_dir, 'array_metadatas'))
  streaming._write_json(os.path.join(out_dir, 'array_metadatas', 'process_0'), {'array_metadatas': entries})


def _write_commit(directory: str, final: str) -> None:
  """`commit_success.txt`, as Orbax writes it where the source has one."""
  with open(os.path.join(directory, COMMIT), 'w') as f:
    f.write(f'Checkpoint commit was successful to {final}')


def _write_item_dir(item: Item, layout: Layout, jobs: Sequence[_Job], out_dir: str, final: str,
                    state: streaming.Progress | None = None,
                    progress: Callable[[streaming.Progress], None] | None = None) -> None:
  """One converted Orbax item: arrays, `_METADATA`, `_sharding`, `array_metadatas`."""
  # The source's array format (zarr or zarr3), so that arrays whose bytes do not change copy as they are.
  writer = _Writer(out_dir, zarr3=bool(item.metadata.get('use_zarr3', False)) or not item.arrays)
  try:
    _write_jobs(jobs, item, writer, state, progress)
    writer.finish_as(layout, item.metadata)
  except BaseException:
    writer.abandon()
    raise
  sharding = _sharding_entries(item, jobs)
  if sharding is not None:
    streaming._write_json(os.path.join(out_dir, SHARDING), sharding)
  _write_array_metadatas(out_dir, jobs, writer)
  if os.path.exists(os.path.join(item.item_dir, COMMIT)):
    _write_commit(out_dir, final)


def _write_checkpoint(item: Item, layout: Layout, jobs: Sequence[_Job], tmp: str, dst: str, custom: dict,
                      state: streaming.Progress | None = None,
                      progress: Callable[[streaming.Progress], None] | None = None) -> None:
  """The converted checkpoint in `tmp`, shaped as SRC is: one StandardCheckpointer directory, or
  a CheckpointManager directory holding the one step (its other items copied)."""
  if item.kind == 'checkpointer':
    _write_item_dir(item, layout, jobs, tmp, dst, state, progress)
    step_dir, final = tmp, dst
  else:
    step_dir, final = os.path.join(tmp, str(item.step)), os.path.join(dst, str(item.step))
    _write_item_dir(item, layout, jobs, os.path.join(step_dir, item.item), os.path.join(final, item.item),
                    state, progress)
    for name in item.others:
      shutil.copytree(os.path.join(item.step_dir, name), os.path.join(step_dir, name))
  base = streaming._read_json(os.path.join(item.step_dir, CHECKPOINT_METADATA), 'Orbax step metadata')
  names = [item.item] + list(item.others) if item.kind == 'manager' else []
  streaming.write_step_metadata(step_dir, names, {'parity_convert': custom}, base=base)
  if item.kind == 'manager' and os.path.exists(os.path.join(item.step_dir, COMMIT)):
    _write_commit(step_dir, final)
