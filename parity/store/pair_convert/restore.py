"""Restoring a side's own checkpoint as its own code does, and verifying a conversion by one step."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

import parity.store.pair_convert.atomic as atomic
from parity.store.pair_convert.atomic import ConvertError
from parity.store.pair_convert.layouts import Layout, OWN_FORMATS, ROLES
from parity.store.pair_convert.reading import Item, _integer_scalar


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
    if own is not None:  # a declared tree: its disk path names the state leaf it holds
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

  def restore(target):
    if item.kind == 'checkpointer':
      return ocp.StandardCheckpointer().restore(item.item_dir, target)
    with _orbax_warnings_quiet():  # read-only by design: Orbax's warnings that it is say nothing
      manager = ocp.CheckpointManager(item.path, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
      try:
        return manager.restore(item.step, args=ocp.args.Composite(
            **{item.item: ocp.args.StandardRestore(target)}))[item.item]
      finally:
        manager.close()

  try:
    flat = paths.flatten(restore(abstract_target(side, layout)))
  except ValueError as e:
    if 'tree structures do not match' not in str(e):
      raise
    # The same leaves under other containers (the kit's checkpoints nest the layout in dicts where the
    # state holds tuples, parity/store/checkpoints.py): restored by the tree as saved, then matched by path.
    flat = _by_disk(layout, paths.flatten(restore(_saved_target(side, layout, item))))
  if layout.format in OWN_FORMATS:
    flat = _own_to_native(layout, side, flat)
  state = paths.fill(f'{item.describe()} -> {layout.role} state', side.template, flat)
  return _uncommitted(state) if side.mesh is None else state


def _saved_target(side: Any, layout: Layout, item: Item) -> dict[str, Any]:
  """The abstract tree as saved (nested dicts by the on-disk keys), each array in its leaf's sharding."""
  import jax

  shardings = _native_shardings(side)
  by_disk = layout.by_disk()
  tree: dict[str, Any] = {}
  for disk, stored in item.arrays.items():
    leaf = by_disk.get(disk)
    node = tree
    *parents, last = disk.split('/')
    for key in parents:
      node = node.setdefault(key, {})
    sharding = shardings.get(leaf.native) if leaf is not None else None
    node[last] = jax.ShapeDtypeStruct(stored.shape, stored.dtype, sharding=sharding)
  return tree


def _by_disk(layout: Layout, flat: Mapping[str, Any]) -> dict[str, Any]:
  """Restored arrays by the state paths of the layout's leaves they are on disk."""
  by_disk = layout.by_disk()
  return {by_disk[disk].native if disk in by_disk else disk: value for disk, value in flat.items()}


@contextlib.contextmanager
def _orbax_warnings_quiet() -> Iterator[None]:
  """Orbax's (absl's) warnings held back while opening a checkpoint read-only."""
  logger = logging.getLogger('absl')
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


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
            f' ({dst_layout.format}): {type(e).__name__}: {atomic._first_line(e)}']
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
