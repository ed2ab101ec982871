"""Reading an Orbax checkpoint's metadata and array headers, and naming the layout it is in."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from parity.core.errors import Problem
from parity.core.errors import TreeMismatchError
import parity.store.pair_convert.atomic as atomic
import parity.store.pair_convert.streaming as streaming
from parity.store.pair_convert.atomic import ConvertError
from parity.store.pair_convert.layouts import ARRAY_TYPES, CHECKPOINT_METADATA, Layout, METADATA, ORBAX_TMP


@dataclasses.dataclass(frozen=True)
class Stored:
  """One array as an Orbax item holds it."""

  disk: str
  name: str  # Orbax's parameter name ('.'-joined keys): the store's path
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]
  value_metadata: dict[str, Any]
  zarr3: bool
  ocdbt: bool

  @property
  def nbytes(self) -> int:
    """Its bytes, decoded."""
    return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class Item:
  """A checkpoint's train-state item: where it is, and what it holds."""

  path: str  # the checkpoint as named (absolute)
  kind: str  # 'checkpointer' (a StandardCheckpointer directory) or 'manager' (a CheckpointManager step's item)
  item_dir: str
  step: int | None = None
  item: str | None = None
  others: tuple[str, ...] = ()  # the step's other items, copied as they are
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
  arrays: dict[str, Stored] = dataclasses.field(default_factory=dict, repr=False)

  def describe(self) -> str:
    """Where it is, for messages."""
    if self.kind == 'checkpointer':
      return self.path
    return f'{self.path} step {self.step} item {self.item!r}'

  @property
  def step_dir(self) -> str:
    """The directory holding its `_CHECKPOINT_METADATA`."""
    return self.item_dir if self.kind == 'checkpointer' else os.path.dirname(self.item_dir)


def _unreadable(disk: str, item_dir: str, error: BaseException) -> str:
  """One line naming the leaf and the checkpoint it cannot be read from (tensorstore's spec left out)."""
  return (f'array {disk} in {item_dir} cannot be read (file missing, truncated or corrupted):'
          f' {atomic._write_failure(error)}')


def _store_spec(item_dir: str, name: str, zarr3: bool, ocdbt: bool) -> dict[str, Any]:
  """The tensorstore spec of one array of an Orbax item, as Orbax lays it out."""
  if ocdbt:
    kvstore = {**streaming._ocdbt_spec(item_dir, write=False), 'path': name + '/'}
  else:
    kvstore = {'driver': 'file', 'path': os.path.join(os.path.abspath(item_dir), name) + '/'}
  return {'driver': 'zarr3' if zarr3 else 'zarr', 'kvstore': kvstore}


def _unfinished(path: str, what: str) -> None:
  """Refuses a directory Orbax has not finished saving (its temporary name)."""
  if ORBAX_TMP in os.path.basename(os.path.normpath(path)):
    raise ConvertError(f'{what} {path} is an unfinished Orbax save (a temporary directory Orbax renames'
                       ' once the save completes): half-written, not a checkpoint')


def read_item(item_dir: str, what: str) -> tuple[dict[str, Any], dict[str, Stored]]:
  """(`_METADATA`, `{disk path: Stored}`) of an Orbax PyTree item: zarr or zarr3, OCDBT or not."""
  import tensorstore as ts

  if not os.path.exists(os.path.join(item_dir, METADATA)):
    raise ConvertError(f'{what} {item_dir} is not an Orbax PyTree checkpoint: {METADATA} is missing'
                       ' (a half-written save, or another kind of item)')
  metadata = streaming._read_json(os.path.join(item_dir, METADATA), 'Orbax tree metadata')
  tree = metadata.get('tree_metadata') if isinstance(metadata, dict) else None
  if not isinstance(tree, dict):
    raise ConvertError(f'{item_dir}/{METADATA} is not Orbax tree metadata (no tree_metadata)')
  zarr3, ocdbt = bool(metadata.get('use_zarr3', False)), bool(metadata.get('use_ocdbt', False))
  if ocdbt and not os.path.exists(os.path.join(item_dir, 'manifest.ocdbt')):
    raise ConvertError(f'{what} {item_dir}: its OCDBT manifest (manifest.ocdbt) is missing: truncated or half-written')
  context = ts.Context({'cache_pool': {'total_bytes_limit': 0}})
  pending = []
  for entry in tree.values():
    keys = [str(k['key']) for k in entry.get('key_metadata', ())]
    value = dict(entry.get('value_metadata') or {})
    disk = '/'.join(keys)
    if value.get('value_type') not in ARRAY_TYPES:
      if value.get('skip_deserialize'):
        continue  # an empty node's placeholder
      raise ConvertError(f'{what} {item_dir}: leaf {disk} is a {value.get("value_type")!r}, not an array')
    name = '.'.join(keys)
    pending.append((disk, name, value, ts.open(_store_spec(item_dir, name, zarr3, ocdbt), read=True, open=True,
                                               context=context)))
  arrays = {}
  for disk, name, value, future in pending:
    try:
      store = future.result()
    except Exception as e:  # tensorstore raises ValueError and others
      raise ConvertError(_unreadable(disk, item_dir, e)) from None
    arrays[disk] = Stored(disk, name, tuple(store.shape), np.dtype(store.dtype.numpy_dtype),
                          tuple(store.chunk_layout.read_chunk.shape or store.shape), value, zarr3, ocdbt)
  return metadata, arrays


def _pytree_items(step_dir: str) -> tuple[list[str], list[str]]:
  """(PyTree items, other items) of a CheckpointManager step directory."""
  names = sorted(n for n in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, n)))
  trees = [n for n in names if os.path.exists(os.path.join(step_dir, n, METADATA))]
  return trees, [n for n in names if n not in trees]


# The command-line flag that picks each checkpoint's step (convert's SRC; diff-checkpoints' A and B).
_STEP_FLAGS = {'SRC': '--step', 'A': '--step-a', 'B': '--step-b'}


def locate(path: str | os.PathLike, what: str, step: int | None = None, item: str | None = None,
           layouts: Mapping[str, Layout] | None = None) -> Item:
  """The train-state item of a StandardCheckpointer directory or of one step (default: the
  latest) of a CheckpointManager directory, read (metadata and array headers, no data)."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.exists(path):
    raise ConvertError(f'{what} {path} does not exist')
  if not os.path.isdir(path):
    raise ConvertError(f'{what} {path} is a file, not an Orbax checkpoint directory')
  _unfinished(path, what)
  step_flag = _STEP_FLAGS.get(what, '--step')
  if os.path.exists(os.path.join(path, METADATA)):  # a StandardCheckpointer directory
    step_dir = os.path.dirname(path)
    if (not os.path.exists(os.path.join(path, CHECKPOINT_METADATA))
        and os.path.exists(os.path.join(step_dir, CHECKPOINT_METADATA))):
      raise ConvertError(f'{what} {path} is item {os.path.basename(path)!r} of step {os.path.basename(step_dir)}'
                         f' of the CheckpointManager directory {os.path.dirname(step_dir)}: pass that directory'
                         f' (with {step_flag} {os.path.basename(step_dir)} --item {os.path.basename(path)})')
    if step is not None or item is not None:
      raise ConvertError(f'{what} {path} is one StandardCheckpointer save: it has no steps or items to choose')
    if not os.path.exists(os.path.join(path, CHECKPOINT_METADATA)):
      raise ConvertError(f'{what} {path} is half-written: {CHECKPOINT_METADATA} is missing (Orbax writes it'
                         ' when the save completes)')
    metadata, arrays = read_item(path, what)
    return Item(path, 'checkpointer', path, metadata=metadata, arrays=arrays)
  if os.path.exists(os.path.join(path, CHECKPOINT_METADATA)):
    raise ConvertError(f'{what} {path} is one step of a CheckpointManager directory; pass its parent'
                       f' (and {step_flag} {os.path.basename(path)})')
  names = os.listdir(path)
  steps = sorted(int(n) for n in names if n.isdigit() and os.path.exists(os.path.join(path, n, CHECKPOINT_METADATA)))
  if step is None and not steps:
    unfinished = sorted(n for n in names if ORBAX_TMP in n or (n.isdigit() and os.path.isdir(os.path.join(path, n))))
    if unfinished:
      raise ConvertError(f'{what} {path} holds no finished step, only unfinished or half-written saves: {unfinished}')
    raise ConvertError(f'{what} {path} is not an Orbax checkpoint: neither a StandardCheckpointer directory'
                       f' ({METADATA}) nor a CheckpointManager directory (<step>/{CHECKPOINT_METADATA})')
  if step is None:
    step = steps[-1]
  elif step not in steps:
    if os.path.isdir(os.path.join(path, str(step))):
      raise ConvertError(f'{what} {path} step {step} is half-written: {step}/{CHECKPOINT_METADATA} is missing')
    raise ConvertError(f'{what} {path} has no step {step}; steps there: {steps or "none"}')
  step_dir = os.path.join(path, str(step))
  trees, others = _pytree_items(step_dir)
  if item is not None:
    if item not in trees:
      raise ConvertError(f'{what} {path} step {step} has no PyTree item {item!r}; its PyTree items: {trees or "none"}')
    chosen = [item]
  else:
    chosen = trees
  read = {name: read_item(os.path.join(step_dir, name), what) for name in chosen}
  if len(read) > 1 and layouts is not None:  # the item that is one side's state of the pair
    matching = [name for name, (_, arrays) in read.items() if any(not _problems(l, arrays) for l in layouts.values())]
    if not matching:  # none is the pair's: the one nearest a layout, so its every difference is named
      share = {name: max((len(set(l.by_disk()) & set(arrays)) / max(len(l.leaves), 1) for l in layouts.values()),
                         default=0) for name, (_, arrays) in read.items()}
      best = max(share.values(), default=0)
      matching = [name for name, value in share.items() if value == best] if best > 0 else []
    if len(matching) == 1:
      read = {matching[0]: read[matching[0]]}
  if len(read) != 1:
    raise ConvertError(f'{what} {path} step {step} has {len(read)} PyTree items ({", ".join(read) or "none"})'
                       f'{" that match the pair" if layouts is not None and read else ""}: name the train'
                       ' state\'s with --item')
  (name, (metadata, arrays)), = read.items()
  return Item(path, 'manager', os.path.join(step_dir, name), step, name,
              tuple(n for n in trees + others if n != name), metadata, arrays)


def _integer_scalar(shape, dtype) -> bool:
  """Whether a leaf is a counter (the step), whose integer dtype may differ between the sides."""
  return tuple(shape) == () and np.issubdtype(np.dtype(dtype), np.integer)


def _describe(shape, dtype) -> str:
  """`float32[4, 8]`."""
  return f'{np.dtype(dtype).name}{list(shape)}'


def _problems(layout: Layout, arrays: Mapping[str, Stored]) -> list[Problem]:
  """Where `arrays` is not `layout`: every leaf missing, extra, or of another shape or dtype.

  The step may be any integer scalar (a TrainState made by `create` holds a Python int)."""
  problems = []
  expected = layout.by_disk()
  for disk, leaf in expected.items():
    stored = arrays.get(disk)
    where = f' (checkpoint path {leaf.checkpoint})' if leaf.checkpoint and leaf.checkpoint != disk else ''
    if stored is None:
      problems.append(Problem(disk, 'missing', _describe(leaf.shape, leaf.dtype) + where, 'nothing'))
    elif stored.shape != leaf.shape:
      problems.append(Problem(disk, 'shape', str(list(leaf.shape)) + where, str(list(stored.shape))))
    elif stored.dtype != leaf.dtype and not (
        leaf.checkpoint == 'step' and _integer_scalar(stored.shape, stored.dtype)):
      problems.append(Problem(disk, 'dtype', leaf.dtype.name + where, stored.dtype.name))
  for disk in sorted(set(arrays) - set(expected)):
    problems.append(Problem(disk, 'extra', 'nothing', _describe(arrays[disk].shape, arrays[disk].dtype)))
  return problems


def identify(item: Item, layouts: Mapping[str, Layout], pair_name: str, formats: Sequence[str] | None = None,
             exact: bool = True) -> tuple[Layout, list[Problem]]:
  """The layout `item` is in (of `formats`, default all): an exact match, else (with `exact`) a
  TreeMismatchError naming every leaf against the nearest one; without `exact`, the nearest
  layout with its problems, if it holds at least half of that layout's leaves."""
  candidates = [layouts[f] for f in (formats or layouts) if f in layouts]
  scored = []
  for layout in candidates:
    problems = _problems(layout, item.arrays)
    if not problems:
      return layout, []
    present = len(set(layout.by_disk()) & set(item.arrays))
    scored.append((present / max(len(layout.leaves), 1), -len(problems), layout, problems))
  scored.sort(key=lambda s: (s[0], s[1]), reverse=True)
  share, _, layout, problems = scored[0]
  if not exact and share >= 0.5:
    return layout, problems
  formats_named = ', '.join(l.format for l in candidates)
  raise TreeMismatchError(
      f'{item.describe()} is not a checkpoint of pair {pair_name!r} as either side\'s own save code writes'
      f' it (tried {formats_named}); nearest: the {layout.role} side\'s {layout.format!r}', problems)
