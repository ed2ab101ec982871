"""A declared pair's own checkpoints: converted between its two sides, and compared.

A user's training code saves its own state with Orbax, not the kit's layout
(parity/store/checkpoints.py). Four trees are recognised, each as Orbax
writes it (`ocp.StandardCheckpointer().save(path, tree)`, or an item of a
`CheckpointManager` step, `args=ocp.args.Composite(state=ocp.args.StandardSave(tree))`):

  linen          the Linen side's TrainState as its `create` makes it (logical-axis
                 boxes kept: `<path>/value` on disk)
  linen-unboxed  the same TrainState unboxed (as StockLinen trains it; the same as
                 `linen` where the model makes no boxes)
  nnx            `nnx.state((model, optimizer))`: `0/<model path>/value`, `1/step/value`,
                 `1/opt_state/<int-keyed chain>/.../value`
  nnx-pure       `nnx.to_pure_dict` of it (no `/value`)

Each leaf on disk is matched to the pair's checkpoint layout through the
pair's sides (`parity.pairs.adapter.make_pair_sides`: the correspondences
given or inferred): the side's `_checkpoint_leaves` of its own template
names every leaf, so optimizer state of any optax chain is matched by
structure (Linen's tuple with its `EmptyState` placeholders, NNX's int-keyed
dicts), extra collections (`batch_stats`) by the side's collections, the
step by name (int32 on Linen, uint32 on `nnx.Optimizer`: cast exactly). State
only NNX keeps (`StockNnx.nnx_only`, RNG streams) is left out of a Linen
checkpoint and initialised as the pair's `create(0)` makes it in an NNX one.
A leaf whose shape differs between the sides (an axis the layout moves) is
refused: that is `parity convert --layout`'s job.

It streams as parity/store/convert.py does: each array is read and written
chunk by chunk, in the source's array format (zarr or zarr3, whichever Orbax
wrote), so an array whose bytes do not change has its encoded chunks copied
as they are, after one decode to catch damage; host memory stays near a few
chunks, never the model. The output goes into a temporary directory beside DST,
renamed into place only when complete (and, with `verify`, verified): a
failure leaves nothing at DST and never touches SRC. `_METADATA` is written
in Orbax's own order with its placeholders, so the other side's own restore
code (`StandardCheckpointer().restore(path, abstract_state)`) reads it.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from parity.core.errors import Problem, TreeMismatchError
from parity.store import convert
from parity.store.convert import ConvertError

METADATA = '_METADATA'
CHECKPOINT_METADATA = '_CHECKPOINT_METADATA'
COMMIT = 'commit_success.txt'
SHARDING = '_sharding'
ORBAX_TMP = '.orbax-checkpoint-tmp'
FORMATS = ('linen', 'linen-unboxed', 'nnx', 'nnx-pure')
# A side's own layout, declared by the tree its save code builds (Pair.saves; parity/store/own_layout.py).
OWN_FORMATS = ('linen-own', 'nnx-own')
SIDE_OF_FORMAT = {'linen': 'linen', 'linen-unboxed': 'linen', 'nnx': 'nnx', 'nnx-pure': 'nnx',
                  'linen-own': 'linen', 'nnx-own': 'nnx'}
ARRAY_TYPES = ('jax.Array', 'np.ndarray', 'scalar')
ROLES = ('linen', 'nnx')


# ------------------------------------------------------------ the layouts ---


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array of a side's own checkpoint: where it is on disk, in the side's state and in the pair's layout."""

  disk: str  # '/'-joined Orbax keys
  native: str  # its path in the side's state (parity.core.paths.flatten)
  checkpoint: str | None  # its path in the pair's checkpoint layout; None: state only NNX keeps
  shape: tuple[int, ...]  # as stored (a typed key: its key data)
  dtype: np.dtype
  keys: tuple[tuple[str, int], ...]  # Orbax's key names and key types (1 sequence, 2 dict)
  typed_key: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """One side's own checkpoint of the pair's state in one of FORMATS: its leaves and empty nodes, in Orbax's order."""

  role: str  # 'linen' or 'nnx'
  format: str
  leaves: tuple[Leaf, ...]
  empties: tuple[tuple[tuple[tuple[str, int], ...], str], ...]  # (keys, Orbax value type)
  order: tuple[tuple[tuple[str, int], ...], ...]  # every leaf's and empty node's keys, as Orbax flattens
  tree: Any = dataclasses.field(repr=False)  # the abstract tree as the side's code saves it

  def by_disk(self) -> dict[str, Leaf]:
    """Its leaves by their path on disk."""
    return {leaf.disk: leaf for leaf in self.leaves}

  def by_checkpoint(self) -> dict[str, Leaf]:
    """Its leaves by their path in the pair's checkpoint layout (state only NNX keeps left out)."""
    return {leaf.checkpoint: leaf for leaf in self.leaves if leaf.checkpoint is not None}


def _keys(keypath: Sequence[Any]) -> tuple[tuple[str, int], ...]:
  """Orbax's (name, key type) of each key of a jax key path."""
  import jax

  out = []
  for key in keypath:
    if isinstance(key, jax.tree_util.SequenceKey):
      out.append((str(key.idx), 1))
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
      out.append((str(key.key), 1))
    elif isinstance(key, jax.tree_util.DictKey):
      out.append((str(key.key), 2))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      out.append((key.name, 2))
    else:
      raise ConvertError(f'a key Orbax cannot save: {key!r}')
  return tuple(out)


def _needs(side: Any, role: str) -> None:
  """Refuses a side whose own state layout cannot be read (no template, no `_checkpoint_leaves`)."""
  missing = [m for m in ('template', '_checkpoint_leaves') if not hasattr(side, m)]
  if missing:
    raise ConvertError(
        f'the pair\'s {role} side ({type(side).__name__}) has no {" or ".join(missing)}: a --pair'
        ' conversion reads the side\'s own state layout from them (parity.StockLinen and'
        ' parity.StockNnx have them, as do the reference decoder\'s sides)')


def checkpoint_paths(side: Any) -> dict[str, str]:
  """`{native path: checkpoint path}` of a side's state: its `_checkpoint_leaves` of its own
  template with every leaf replaced by its path (state outside the layout is absent)."""
  import jax
  from flax import nnx
  from flax.core import meta

  from parity.core import compat
  from parity.core import paths

  leaves, treedef = jax.tree_util.tree_flatten_with_path(side.template, is_leaf=paths._is_variable)
  marks = []
  for keypath, leaf in leaves:
    name = paths._path_str(keypath)
    if isinstance(leaf, nnx.Variable):
      marks.append(compat.nnx_variable_with_value(leaf, name))
    elif isinstance(leaf, meta.AxisMetadata):
      marks.append(leaf.replace_boxed(name))
    else:
      marks.append(name)
  named = side._checkpoint_leaves(treedef.unflatten(marks))
  return {native: ckpt for ckpt, native in named.items() if isinstance(native, str)}


def _format_tree(side: Any, fmt: str) -> Any:
  """The abstract tree a side's own code saves in format `fmt`."""
  from flax import nnx

  if fmt == 'linen':
    return getattr(side, '_boxed_template', side.template)
  if fmt == 'nnx-pure':
    return nnx.to_pure_dict(side.template)
  return side.template


def side_layout(side: Any, role: str, fmt: str) -> Layout:
  """The leaves of `side`'s own checkpoint in format `fmt`, in the order Orbax saves them."""
  import jax

  from parity.core import compat
  from parity.core import paths

  _needs(side, role)
  native = paths.flatten(side.template)
  to_checkpoint = checkpoint_paths(side)
  tree = _format_tree(side, fmt)
  is_node = lambda x: paths._is_variable(x) or compat.orbax_empty_or_leaf(x)
  leaves, empties, order = [], [], []
  for keypath, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]:
    keys = _keys(keypath)
    name = paths._path_str(keypath)
    if paths._is_variable(node):
      inner = jax.tree_util.tree_flatten_with_path(node, is_leaf=compat.orbax_empty_or_leaf)[0]
      if len(inner) != 1:
        raise ConvertError(f'{role} side: {name} holds {len(inner)} arrays, not one')
      keys += _keys(inner[0][0])
    elif node is None or not hasattr(node, 'shape'):
      empties.append((keys, compat.orbax_empty_typestr(node)))
      order.append(keys)
      continue
    abstract = native[name]
    typed = jax.dtypes.issubdtype(abstract.dtype, jax.dtypes.prng_key)
    if typed:
      abstract = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(abstract.shape, abstract.dtype))
    leaves.append(Leaf('/'.join(k for k, _ in keys), name, to_checkpoint.get(name), tuple(abstract.shape),
                       np.dtype(abstract.dtype), keys, typed))
    order.append(keys)
  return Layout(role, fmt, tuple(leaves), tuple(empties), tuple(order), tree)


def pair_layouts(sides: Sequence[Any], saves: Mapping[str, Any] | None = None) -> dict[str, Layout]:
  """Each side's own declared layout (`saves`: role -> the function building the tree its code
  saves; first, so a checkpoint that is also a stock tree is named as the side's own), then each of
  FORMATS (`linen-unboxed` only where it differs from `linen`)."""
  from parity.store import own_layout

  out = {}
  for role, save in sorted((saves or {}).items(), key=lambda kv: ROLES.index(kv[0]) if kv[0] in ROLES else -1):
    if role not in ROLES:
      raise ConvertError(f"Pair saves: keys are 'linen' and 'nnx', got {role!r}")
    out[own_layout.own_format(role)] = own_layout.own_layout(sides[ROLES.index(role)], role, save)
  for fmt in FORMATS:
    role = SIDE_OF_FORMAT[fmt]
    side = sides[ROLES.index(role)]
    if fmt == 'linen-unboxed' and not hasattr(side, '_boxed_template'):
      continue
    layout = side_layout(side, role, fmt)
    if fmt == 'linen-unboxed' and [l.disk for l in layout.leaves] == [l.disk for l in out['linen'].leaves]:
      continue  # no boxes: the same tree
    out[fmt] = layout
  return out


# ------------------------------------------------------- reading the disk ---


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
          f' {convert._write_failure(error)}')


def _store_spec(item_dir: str, name: str, zarr3: bool, ocdbt: bool) -> dict[str, Any]:
  """The tensorstore spec of one array of an Orbax item, as Orbax lays it out."""
  if ocdbt:
    kvstore = {**convert._ocdbt_spec(item_dir, write=False), 'path': name + '/'}
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
  metadata = convert._read_json(os.path.join(item_dir, METADATA), 'Orbax tree metadata')
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
    if len(matching) == 1:
      read = {matching[0]: read[matching[0]]}
  if len(read) != 1:
    raise ConvertError(f'{what} {path} step {step} has {len(read)} PyTree items ({", ".join(read) or "none"})'
                       f'{" that match the pair" if layouts is not None and read else ""}: name the train'
                       ' state\'s with --item')
  (name, (metadata, arrays)), = read.items()
  return Item(path, 'manager', os.path.join(step_dir, name), step, name,
              tuple(n for n in trees + others if n != name), metadata, arrays)


# ---------------------------------------------------------------- matching ---


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


# ---------------------------------------------------------------- writing ---


class _Writer(convert.ItemWriter):
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
        'kvstore': {**convert._ocdbt_spec(self.item_dir, write=True), 'path': path.replace('/', '.') + '/'},
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
    convert._write_json(os.path.join(self.item_dir, METADATA), out)


@dataclasses.dataclass(frozen=True)
class _Job:
  """One array of the output: copied from a source array, or a value of `create(0)`."""

  target: Leaf
  source: Stored | None  # None: a value of `create(0)` (state only NNX keeps)
  value: np.ndarray | None = None
  key_impl: str | None = None  # a typed key's implementation (Orbax's `random_key_impl`)

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


def _plan(source: Layout, item: Item, target: Layout,
          values: Mapping[str, tuple[np.ndarray, str | None]]) -> tuple[list[_Job], list[str]]:
  """(a job per target leaf, the source leaves the target has no place for: state only NNX keeps)."""
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
    if stored.shape != leaf.shape:
      problems.append(Problem(leaf.checkpoint, 'shape', f'{target.role} {leaf.disk} {list(leaf.shape)}',
                              f'{source.role} {src.disk} {list(stored.shape)}: the sides store it in other'
                              ' shapes (an axis moved: parity convert --layout)'))
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
  if math.prod(stored.chunk) * stored.dtype.itemsize <= convert.ALIGNED_CHUNK_BYTES:
    return stored.chunk
  return convert.box_shape(stored.shape, stored.dtype.itemsize)


def _write_jobs(jobs: Sequence[_Job], item: Item, writer: _Writer) -> None:
  """Every job's array: its encoded chunks copied (OCDBT, the writer's format, the same dtype), else read
  and written chunk by chunk."""
  import tensorstore as ts

  src_kv = None
  for job in jobs:
    leaf, stored = job.target, job.source
    path = leaf.disk
    value_metadata = {'value_type': 'jax.Array', 'skip_deserialize': False}
    if stored is None:
      data = job.value.astype(leaf.dtype, copy=False)
      box = tuple(slice(0, n) for n in data.shape)
      writer.write(path, data.shape, data.dtype, data.shape or (), iter([(box, data)]), value_metadata)
      continue
    context = ts.Context({'cache_pool': {'total_bytes_limit': 0}})
    store = ts.open(_store_spec(item.item_dir, stored.name, stored.zarr3, stored.ocdbt), read=True, open=True,
                    context=context).result()
    cast = stored.dtype != leaf.dtype
    if stored.zarr3 == writer.zarr3 and stored.ocdbt and not cast:
      for box in convert._boxes(stored.shape, stored.chunk):  # decoded once, to catch damage
        try:
          store[box].read().result()
        except Exception as e:  # tensorstore raises ValueError and others
          raise ConvertError(_unreadable(stored.disk, item.item_dir, e)) from None
      if src_kv is None:
        src_kv = ts.KvStore.open(convert._ocdbt_spec(item.item_dir, write=False), context=ts.Context()).result()
      writer.copy(path, src_kv, stored.name, stored.chunk, value_metadata)
      continue
    chunk = _box_chunk(stored)

    def boxes(store=store, stored=stored, chunk=chunk, cast=cast, leaf=leaf):
      for box in convert._boxes(stored.shape, chunk):
        try:
          data = store[box].read().result()
        except Exception as e:  # tensorstore raises ValueError and others
          raise ConvertError(_unreadable(stored.disk, item.item_dir, e)) from None
        yield box, (convert._exact_cast(f'{stored.disk} ({leaf.checkpoint})', data, leaf.dtype) if cast else data)

    writer.write(path, stored.shape, leaf.dtype, chunk, boxes(), value_metadata)


def _sharding_entries(item: Item, jobs: Sequence[_Job]) -> dict[str, str] | None:
  """`_sharding` of the converted item: each source leaf's entry under its new name; state only
  NNX keeps, which has none, replicated where the source records a mesh."""
  path = os.path.join(item.item_dir, SHARDING)
  if not os.path.exists(path):
    return None
  src = convert._read_json(path, 'Orbax sharding metadata')
  encode = lambda name: base64.urlsafe_b64encode(name.encode()).decode()
  out, fallback = {}, None
  for job in jobs:
    if job.source is not None and encode(job.source.name) in src:
      out[encode(job.target.disk.replace('/', '.'))] = src[encode(job.source.name)]
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
  convert._write_json(os.path.join(out_dir, 'array_metadatas', 'process_0'), {'array_metadatas': entries})


def _write_commit(directory: str, final: str) -> None:
  """`commit_success.txt`, as Orbax writes it where the source has one."""
  with open(os.path.join(directory, COMMIT), 'w') as f:
    f.write(f'Checkpoint commit was successful to {final}')


def _write_item_dir(item: Item, layout: Layout, jobs: Sequence[_Job], out_dir: str, final: str) -> None:
  """One converted Orbax item: arrays, `_METADATA`, `_sharding`, `array_metadatas`."""
  # The source's array format (zarr or zarr3), so that arrays whose bytes do not change copy as they are.
  writer = _Writer(out_dir, zarr3=bool(item.metadata.get('use_zarr3', False)) or not item.arrays)
  try:
    _write_jobs(jobs, item, writer)
    writer.finish_as(layout, item.metadata)
  except BaseException:
    writer.abandon()
    raise
  sharding = _sharding_entries(item, jobs)
  if sharding is not None:
    convert._write_json(os.path.join(out_dir, SHARDING), sharding)
  _write_array_metadatas(out_dir, jobs, writer)
  if os.path.exists(os.path.join(item.item_dir, COMMIT)):
    _write_commit(out_dir, final)


def _write_checkpoint(item: Item, layout: Layout, jobs: Sequence[_Job], tmp: str, dst: str, custom: dict) -> None:
  """The converted checkpoint in `tmp`, shaped as SRC is: one StandardCheckpointer directory, or
  a CheckpointManager directory holding the one step (its other items copied)."""
  if item.kind == 'checkpointer':
    _write_item_dir(item, layout, jobs, tmp, dst)
    step_dir, final = tmp, dst
  else:
    step_dir, final = os.path.join(tmp, str(item.step)), os.path.join(dst, str(item.step))
    _write_item_dir(item, layout, jobs, os.path.join(step_dir, item.item), os.path.join(final, item.item))
    for name in item.others:
      shutil.copytree(os.path.join(item.step_dir, name), os.path.join(step_dir, name))
  base = convert._read_json(os.path.join(item.step_dir, CHECKPOINT_METADATA), 'Orbax step metadata')
  names = [item.item] + list(item.others) if item.kind == 'manager' else []
  convert.write_step_metadata(step_dir, names, {'parity_convert': custom}, base=base)
  if item.kind == 'manager' and os.path.exists(os.path.join(item.step_dir, COMMIT)):
    _write_commit(step_dir, final)


def _check_dst(src: str, dst: str) -> None:
  """Refuses a DST that exists, overlaps SRC or has no parent directory."""
  src_real, dst_real = os.path.realpath(src), os.path.realpath(dst)
  if dst_real == src_real or dst_real.startswith(src_real + os.sep) or src_real.startswith(dst_real + os.sep):
    raise ConvertError(f'DST {dst} and SRC {src} overlap; DST must be outside SRC')
  if os.path.lexists(dst):
    raise ConvertError(f'DST {dst} exists; a conversion writes a new checkpoint (remove it, or choose another DST)')
  parent = os.path.dirname(dst_real)
  if not os.path.isdir(parent):
    raise ConvertError(f'DST parent directory {parent} does not exist')


# ------------------------------------------------------------ the sides ---

# Each pair's sides per mesh, made once per process: (pair, mesh, sides).
_SIDES: dict[tuple[int, Any], tuple[Any, Any]] = {}


def pair_sides(pair: Any, mesh: Any = None) -> tuple[Any, Any]:
  """`make_pair_sides(pair, mesh)`, once per pair and mesh in a process (templates and correspondences)."""
  from parity.pairs import adapter

  key = (id(pair), mesh)
  cached = _SIDES.get(key)
  if cached is None or cached[0] is not pair:
    cached = (pair, adapter.make_pair_sides(pair, mesh))
    _SIDES[key] = cached
  return cached[1]


# --------------------------------------------------------- restore, verify ---


def _native_shardings(side: Any) -> dict[str, Any]:
  """Each leaf of the side's state where the side places it (off a mesh: the default device)."""
  import jax

  from parity.core import paths

  if side.mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {p: one for p in paths.flatten(side.template)}
  flat = paths.flatten(side.state_shardings) if side.state_shardings is not None else {}
  replicated = jax.sharding.NamedSharding(side.mesh, jax.sharding.PartitionSpec())
  return {p: flat.get(p, replicated) for p in paths.flatten(side.template)}


def abstract_target(side: Any, layout: Layout) -> Any:
  """The abstract tree the side's own restore code passes Orbax: `layout`'s tree, every array a
  ShapeDtypeStruct in the side's sharding."""
  import jax
  from flax import nnx
  from flax.core import meta

  from parity.core import compat
  from parity.core import paths

  shardings = _native_shardings(side)
  # A stock tree is the state's own: its paths are the state's. A declared one names each leaf's source.
  own = {leaf.disk: leaf.native for leaf in layout.leaves} if layout.format in OWN_FORMATS else None

  def one(keypath, node):
    name = paths._path_str(keypath)
    if own is not None and name not in shardings:
      name = own.get(name, own.get(name + '/value', name))
    if isinstance(node, nnx.Variable):
      x = node.get_value()
      return compat.nnx_variable_with_value(node, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[name]))
    if isinstance(node, meta.AxisMetadata):
      x = node.value if hasattr(node, 'value') else node.unbox()
      return node.replace_boxed(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[name]))
    if node is None or not hasattr(node, 'shape'):
      return node
    return jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=shardings[name])

  is_node = lambda x: paths._is_variable(x) or compat.orbax_empty_or_leaf(x)
  return jax.tree_util.tree_map_with_path(one, layout.tree, is_leaf=is_node)


def restore_native(item: Item, layout: Layout, side: Any) -> Any:
  """The side's state from its own checkpoint, restored as its own code restores it (Orbax with
  the abstract state as target), in the side's shardings."""
  import orbax.checkpoint as ocp

  from parity.core import paths

  target = abstract_target(side, layout)
  if item.kind == 'checkpointer':
    restored = ocp.StandardCheckpointer().restore(item.item_dir, target)
  else:
    manager = ocp.CheckpointManager(item.path, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
      restored = manager.restore(item.step, args=ocp.args.Composite(
          **{item.item: ocp.args.StandardRestore(target)}))[item.item]
    finally:
      manager.close()
  flat = paths.flatten(restored)
  if layout.format in OWN_FORMATS:
    flat = _own_to_native(layout, side, flat)
  state = paths.fill(f'{item.describe()} -> {layout.role} state', side.template, flat)
  return _uncommitted(state) if side.mesh is None else state


def own_tree(pair: Any, role: str, side: Any, state: Any) -> Any:
  """The tree `side`'s own save code writes of `state`: the pair's declared `saves[role]` of it, or the
  state itself."""
  from parity.store import own_layout

  save = (getattr(pair, 'saves', None) or {}).get(role)
  return state if save is None else save(own_layout._created(side, state))


def _own_to_native(layout: Layout, side: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
  """A restored own-layout tree's arrays by the state paths they were saved from, each counter cast
  back to the state's integer dtype (a save that casts the step to int32, as Linen keeps it)."""
  import jax.numpy as jnp

  from parity.core import paths

  native = paths.flatten(side.template)
  by_disk = {leaf.disk: leaf for leaf in layout.leaves}
  out = {}
  for disk, value in flat.items():
    leaf = by_disk.get(disk) or by_disk.get(disk + '/value')
    if leaf is None:
      raise ConvertError(f'{disk}: restored, but no leaf of the {layout.role} side\'s own layout')
    want = native[leaf.native]
    if value.dtype != want.dtype and _integer_scalar(value.shape, value.dtype):
      value = value.astype(want.dtype) if hasattr(value, 'astype') else jnp.asarray(value, want.dtype)
    out[leaf.native] = value
  return out


def _uncommitted(tree: Any) -> Any:
  """Off a mesh, arrays as a fresh state places them (parity.store.checkpoints.restore), typed keys too."""
  import jax

  def one(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(x))), impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x))

  return jax.tree.map(one, tree)


def _names(ckpt: str, layouts: Mapping[str, Layout]) -> str:
  """A checkpoint path's leaf named on both sides (their paths on disk)."""
  parts = []
  for fmt, layout in layouts.items():
    leaf = layout.by_checkpoint().get(ckpt)
    if leaf is not None:
      parts.append(f'{fmt}: {leaf.disk}')
  return ' | '.join(parts)


def verify_conversion(pair: Any, src_item: Item, src_layout: Layout, dst_item: Item, dst_layout: Layout,
           sides: Sequence[Any]) -> list[str]:
  """One train step on each side from its own restore of SRC and DST, from the pair's batch 0 and
  dropout base: every leaf (restored, after the step) and metric that is not bit for bit, named on
  both sides. Empty: verified."""
  from parity.core import bitwise
  from parity.core import rng
  from parity.pairs import adapter

  by_role = dict(zip(ROLES, sides))
  src_side, dst_side = by_role[src_layout.role], by_role[dst_layout.role]
  named = {src_layout.format: src_layout, dst_layout.format: dst_layout}
  lines = []
  src_state = restore_native(src_item, src_layout, src_side)
  try:
    dst_state = restore_native(dst_item, dst_layout, dst_side)
  except Exception as e:  # Orbax and jax raise many kinds: the conversion is not what that code reads
    return [f'the conversion cannot be restored by the {dst_layout.role} side\'s own restore code'
            f' ({dst_layout.format}): {type(e).__name__}: {convert._first_line(e)}']
  before = bitwise.compare_trees(src_side.to_checkpoint(src_state), dst_side.to_checkpoint(dst_state),
                                 labels=('SRC', 'DST'))
  lines += [f'restored {d.path} [{_names(d.path, named)}]: {d.kind}: {d.detail}' for d in before]
  batch, base = pair.batch(0, 'train'), rng.base_key(pair.seed)
  src_next, src_metrics = src_side.train_step(src_state, src_side.place_batch(batch), base)
  dst_next, dst_metrics = dst_side.train_step(dst_state, dst_side.place_batch(batch), base)
  src_metrics = adapter.checked_metrics(pair.name, src_side, 'train_step', src_metrics, need_loss=True)
  dst_metrics = adapter.checked_metrics(pair.name, dst_side, 'train_step', dst_metrics, need_loss=True)
  after = bitwise.compare_trees(
      {**src_side.to_checkpoint(src_next), **{f'metrics/{k}': v for k, v in src_metrics.items()}},
      {**dst_side.to_checkpoint(dst_next), **{f'metrics/{k}': v for k, v in dst_metrics.items()}},
      labels=('SRC', 'DST'))
  lines += [f'after one step {d.path}' + (f' [{_names(d.path, named)}]' if not d.path.startswith('metrics/') else '')
            + f': {d.kind}: {d.detail}' for d in after]
  return lines


# ------------------------------------------------------------- converting ---


@dataclasses.dataclass
class ConvertResult:
  """What a conversion did; `differences` is `verify`'s (empty: bit for bit, or not verified)."""

  dst: str
  to: str
  source_format: str
  target_format: str
  step: int | None
  arrays: int
  bytes: int
  seconds: float
  dropped: list[str]  # SRC's state only NNX keeps, which the Linen side has no place for
  initialised: list[str]  # DST's state only NNX keeps, as `create(0)` makes it
  verified: bool | None = None  # None: not verified
  differences: list[str] = dataclasses.field(default_factory=list)
  written: bool = True  # False: verification failed, nothing left at DST


def convert_checkpoint(
    pair: Any, src: str | os.PathLike, dst: str | os.PathLike, to: str, *, step: int | None = None,
    item: str | None = None, target_format: str | None = None, verify: bool = False, mesh: Any = None,
    sides: Sequence[Any] | None = None,
) -> ConvertResult:
  """Converts SRC, written by one side's own save code, into DST, which the other side's own restore
  code reads, through the pair's correspondences.

  `to`: 'linen' or 'nnx'. `target_format`: one of that side's FORMATS (default: `linen`, or
  `nnx` for `nnx.state((model, optimizer))`). `step`, `item`: of a CheckpointManager SRC (default: its
  latest step; the item that is one side's state). `verify`: restore both with the sides' own
  restore code and take one train step on each (on `mesh`; None: one device), and leave DST only
  when every leaf is bit for bit. Raises ConvertError or TreeMismatchError on bad input, with
  nothing written.
  """
  start = time.perf_counter()
  src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
  if to not in ROLES:
    raise ConvertError(f"--to must be 'linen' or 'nnx', got {to!r}")
  # Default: the layout the target side's own restore code reads (its declared one, else its stock tree).
  target_format = target_format or (f'{to}-own' if to in (getattr(pair, 'saves', None) or {}) else to)
  if SIDE_OF_FORMAT.get(target_format) != to:
    raise ConvertError(f'target format {target_format!r} is not the {to} side\'s; its formats:'
                       f' {[f for f, r in SIDE_OF_FORMAT.items() if r == to]}')
  sides = tuple(sides) if sides is not None else pair_sides(pair, mesh)
  layouts = pair_layouts(sides, getattr(pair, 'saves', None))
  if target_format not in layouts:
    if target_format in OWN_FORMATS:
      raise ConvertError(f'target format {target_format!r}: pair {pair.name!r} declares no saves[{to!r}]'
                         ' (the function building the tree the side\'s own save code writes)')
    target_format = to if target_format == 'linen-unboxed' else target_format  # no boxes: one tree
  _check_dst(src, dst)
  source_item = locate(src, 'SRC', step, item, layouts)
  other = [f for f in layouts if SIDE_OF_FORMAT[f] != to]
  try:
    source, _ = identify(source_item, layouts, pair.name, formats=other)
  except TreeMismatchError:
    same = [f for f in layouts if SIDE_OF_FORMAT[f] == to]
    if any(not _problems(layouts[f], source_item.arrays) for f in same):
      raise ConvertError(f'SRC {source_item.describe()} is already the {to} side\'s checkpoint:'
                         f' nothing to convert (--to {"nnx" if to == "linen" else "linen"} converts it)') from None
    raise
  target = layouts[target_format]
  values = nnx_only_values(sides[1], target) if to == 'nnx' else {}
  jobs, dropped = _plan(source, source_item, target, values)
  convert.remove_stale_partials(dst)
  tmp = convert._partial_prefix(dst) + str(os.getpid())
  custom = {'source': src, 'step': source_item.step, 'to': to, 'from_format': source.format,
            'format': target_format, 'pair': pair.name}
  result = ConvertResult(dst, to, source.format, target_format, source_item.step, len(jobs),
                         sum(j.nbytes for j in jobs), 0.0, dropped,
                         [j.target.disk for j in jobs if j.source is None])
  signals = convert._Signals()
  stage = 'writing the converted arrays'
  try:
    with signals:
      _write_checkpoint(source_item, target, jobs, tmp, dst, custom)
      stage = 'syncing the conversion to disk'
      convert._fsync_tree(tmp)
      if verify:
        stage = 'verifying the conversion'
        written = locate(tmp, 'DST', source_item.step, source_item.item)
        result.differences = verify_conversion(pair, source_item, source, written, target, sides)
        result.verified = not result.differences
        if result.differences:
          shutil.rmtree(tmp, ignore_errors=True)
          result.written = False
          result.seconds = time.perf_counter() - start
          return result
      stage = 'moving the conversion into DST'
      with convert._HeldSignals(signals):
        if os.path.lexists(dst):
          raise ConvertError(f'DST {dst} appeared while converting; {convert.NOTHING_WRITTEN}')
        os.rename(tmp, dst)
        signals.moved = True
  except BaseException as e:
    if signals.moved:
      raise
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, (OSError, ValueError)) and not isinstance(e, (ConvertError, TreeMismatchError)):
      raise ConvertError(f'{stage} failed: {convert._write_failure(e)}; {convert.NOTHING_WRITTEN}') from None
    raise
  result.seconds = time.perf_counter() - start
  return result


# -------------------------------------------------------------- comparing ---


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
DIFF_BOX_BYTES = convert.BOX_BYTES


def _chunk_bytes(stored: Stored) -> int:
  return math.prod(stored.chunk) * stored.dtype.itemsize


def _diff_boxes(shape: Sequence[int], chunk: Sequence[int], itemsize: int) -> Iterator[tuple[slice, ...]]:
  """The boxes a diff reads an array in: its stored chunks in C order, each split into boxes of at
  most DIFF_BOX_BYTES (whole trailing axes, leading ones split) where larger."""
  chunk = tuple(max(1, int(c)) for c in chunk)
  if math.prod(chunk) * itemsize <= DIFF_BOX_BYTES:
    yield from convert._boxes(shape, chunk)
    return
  for outer in convert._boxes(shape, chunk):
    extent = [s.stop - s.start for s in outer]
    for inner in convert._boxes(extent, convert.box_shape(extent, itemsize, DIFF_BOX_BYTES)):
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
    return _chunk_bytes(stored) if split and _chunk_bytes(stored) <= convert.ALIGNED_CHUNK_BYTES else 0

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
  raw = convert._read_json(path, 'Orbax sharding metadata')
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
    (leaf_a, sa), (leaf_b, sb) = left, right
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
      (leaf_a, sa), (leaf_b, sb) = ka[key], kb[key]
      if sa is None or sb is None:
        continue
      ea, eb = sh[0].get(sa.name), sh[1].get(sb.name)
      if ea != eb:
        differ(key, 'sharding', f'{ea} vs {eb}')
  lines.sort()
  return CheckpointDiff(items[0].describe(), items[1].describe(), la.format, lb.format, compared, lines, kinds,
                        not_compared)


# ------------------------------------------- a state in the other's layout ---


def _nnx_state(state: Any) -> Any:
  """`nnx.state((model, optimizer))` of a `(model, optimizer)` pair; a State as it is."""
  from flax import nnx

  if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], nnx.Module):
    return nnx.state(state)
  return state


def to_linen_layout(pair: Any, nnx_state: Any, *, boxed: bool = True) -> Any:
  """The NNX side's state (`nnx.state((model, optimizer))`, or the pair itself) as the Linen side's
  TrainState, through the pair's correspondences: what Linen's own restore code reads, so NNX
  training code can save checkpoints a Linen run resumes from. `boxed`: boxes as the Linen side's
  `create` makes them (its restore target), else unboxed."""
  from parity.core import paths
  from parity.core import state as state_lib

  linen, nnx_side = pair_sides(pair, None)
  flat = nnx_side.to_checkpoint(_nnx_state(nnx_state))
  template = getattr(linen, '_boxed_template', linen.template) if boxed else linen.template
  if 'step' in flat:
    flat = {**flat, 'step': state_lib.convert_step(flat['step'], state_lib.LINEN_STEP_DTYPE)}
  return paths.fill('NNX state -> Linen train state', template, flat)


def to_nnx_layout(pair: Any, linen_state: Any, *, pure: bool = False) -> Any:
  """The Linen side's TrainState as the NNX side's `nnx.state((model, optimizer))` (a pure dict with
  `pure`), through the pair's correspondences; state only NNX keeps as `create(0)` makes it. What
  NNX's own restore code reads (or `nnx.update((model, optimizer), state)` takes)."""
  from flax import nnx

  linen, nnx_side = pair_sides(pair, None)
  state = nnx_side.from_checkpoint(linen.to_checkpoint(linen_state))
  return nnx.to_pure_dict(state) if pure else state


# --------------------------------------------------------------------- CLI ---


def add_pair_options(convert_parser) -> None:
  """`parity convert --pair`'s options, beside the reference converter's."""
  convert_parser.add_argument('--pair', default=None, metavar='FILE.py:NAME',
                              help="convert a declared pair's own checkpoint (Orbax StandardCheckpointer or"
                                   ' CheckpointManager, as its save code writes it) to the other side\'s,'
                                   ' through its correspondences')
  convert_parser.add_argument('--verify', action='store_true',
                              help='with --pair: restore SRC and DST with the sides\' own restore code, take'
                                   ' one train step on each and require every leaf bit for bit (exit 1'
                                   ' otherwise, DST not written)')
  convert_parser.add_argument('--item', default=None, help='with --pair: the train state\'s item of a'
                              ' CheckpointManager step (default: the one that matches the pair)')
  convert_parser.add_argument('--format', dest='target_format', default=None, choices=FORMATS + OWN_FORMATS,
                              help='with --pair: the tree DST holds (default: the target side\'s own'
                                   ' layout where the pair declares it, Pair(saves=...), else linen, or nnx'
                                   ' for nnx.state((model, optimizer)); nnx-pure: nnx.to_pure_dict of it)')
  convert_parser.add_argument('--mesh', default=None, help="with --pair --verify: the steps' mesh (default:"
                              ' one device)')


def command_convert(args, pair: Any, mesh: Any) -> int:
  """`parity convert --pair`: exit 0 converted (and verified), 1 verification failed."""
  result = convert_checkpoint(pair, args.src, args.dst, args.to, step=args.step, item=args.item,
                              target_format=args.target_format, verify=args.verify, mesh=mesh)
  what = f'{result.source_format} -> {result.target_format}' + (
      f' (step {result.step})' if result.step is not None else '')
  notes = []
  if result.dropped:
    notes.append(f'left out {len(result.dropped)} leaves only NNX keeps ({", ".join(result.dropped[:4])}'
                 f'{", ..." if len(result.dropped) > 4 else ""})')
  if result.initialised:
    notes.append(f'{len(result.initialised)} leaves only NNX keeps as create(0) makes them'
                 f' ({", ".join(result.initialised[:4])}{", ..." if len(result.initialised) > 4 else ""})')
  if result.verified is False:
    print(f'parity: verification failed: {len(result.differences)} leaves differ after restoring SRC and'
          f' the conversion with each side\'s own code and one train step; nothing written to DST:')
    for line in result.differences:
      print(f'  {line}')
    return 1
  verified = '; verified: one train step on each side, bit for bit' if result.verified else ''
  print(f'converted pair {pair.name} {what}: {result.arrays} arrays, {result.bytes / 2**20:.1f} MiB,'
        f' {result.seconds:.2f} s -> {result.dst}{verified}' + ''.join(f'\n  {n}' for n in notes))
  return 0


def command_diff(args, pair: Any) -> int:
  """`parity diff-checkpoints`: exit 0 equal, 1 different."""
  diff = compare_checkpoints(pair, args.a, args.b, step_a=args.step_a, step_b=args.step_b, item=args.item)
  print(diff.report(limit=args.max_lines))
  return 0 if diff.equal else 1


def add_diff_parser(subparsers, func) -> None:
  """`parity diff-checkpoints`'s arguments."""
  diff = subparsers.add_parser(
      'diff-checkpoints', help="compare two of a pair's checkpoints (either side's) leaf by leaf through its"
                               ' correspondences; exit 0 equal, 1 different, 2 bad input')
  diff.add_argument('a', metavar='A', help='a checkpoint (StandardCheckpointer or CheckpointManager directory)')
  diff.add_argument('b', metavar='B', help='the other')
  diff.add_argument('--pair', required=True, metavar='FILE.py:NAME', help='the pair (a parity.Pair)')
  diff.add_argument('--step-a', type=int, default=None, help="A's step (CheckpointManager; default: latest)")
  diff.add_argument('--step-b', type=int, default=None, help="B's step (CheckpointManager; default: latest)")
  diff.add_argument('--item', default=None, help='the train state\'s item (default: the one that matches)')
  diff.add_argument('--max-lines', type=int, default=200, help='differences printed at most (default 200)')
  diff.set_defaults(func=func)
