"""Each side's own checkpoint layouts of a pair's state: the stock trees, and a declared one."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from parity.store.pair_convert.atomic import ConvertError


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

  # A record standing for the deleted Linen side (parity/records/) gives that side's layouts as recorded.
  recorded = getattr(sides[0], 'recorded_layouts', None)
  recorded = None if recorded is None else recorded()
  out = {}
  for role, save in sorted((saves or {}).items(), key=lambda kv: ROLES.index(kv[0]) if kv[0] in ROLES else -1):
    if role not in ROLES:
      raise ConvertError(f"Pair saves: keys are 'linen' and 'nnx', got {role!r}")
    if role == 'linen' and recorded is not None:
      continue
    out[own_layout.own_format(role)] = own_layout.own_layout(sides[ROLES.index(role)], role, save)
  if recorded is not None:
    out.update({fmt: layout for fmt, layout in recorded.items() if fmt in OWN_FORMATS})
  for fmt in FORMATS:
    role = SIDE_OF_FORMAT[fmt]
    side = sides[ROLES.index(role)]
    if role == 'linen' and recorded is not None:
      if fmt in recorded:
        out[fmt] = recorded[fmt]
      continue
    if fmt == 'linen-unboxed' and not hasattr(side, '_boxed_template'):
      continue
    layout = side_layout(side, role, fmt)
    if fmt == 'linen-unboxed' and [l.disk for l in layout.leaves] == [l.disk for l in out['linen'].leaves]:
      continue  # no boxes: the same tree
    out[fmt] = layout
  return out


def axis_moves(side: Any) -> dict[str, tuple[int, ...]]:
  """`{native path: perm}` of the leaves a side stores with their axes in another order than the pair's
  checkpoint layout (checkpoint = native.transpose(perm)), read off its `to_checkpoint` traced once,
  abstractly: an output that is a transpose of a state leaf (through casts and copies) is moved. Empty
  where the side has no such method or it cannot be traced (a leaf of another shape is then refused)."""
  import jax

  from parity.core import paths

  template = getattr(side, 'template', None)
  if template is None or not hasattr(side, 'to_checkpoint'):
    return {}
  leaves, treedef = jax.tree_util.tree_flatten(template)
  names = [name for name, _ in paths.items(template, paths._is_variable)]
  if len(names) != len(leaves):
    return {}
  traced = [i for i, leaf in enumerate(leaves) if getattr(leaf, 'ndim', 0) > 0]

  def to_checkpoint(*arrays):  # scalars (the step) concrete: a side may read them as Python ints
    full = [np.zeros(leaf.shape, leaf.dtype) if getattr(leaf, 'ndim', 0) == 0 else None for leaf in leaves]
    for i, x in zip(traced, arrays):
      full[i] = x
    return side.to_checkpoint(treedef.unflatten(full))

  try:
    closed = jax.make_jaxpr(to_checkpoint)(*[leaves[i] for i in traced])
  except Exception:  # the side's own code: any error means no moves are read
    return {}
  jaxpr = closed.jaxpr
  invars = {v: names[i] for v, i in zip(jaxpr.invars, traced)}
  made_by = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
  moves = {}
  from parity.core import compat

  for var in jaxpr.outvars:
    if compat.is_jaxpr_literal(var):
      continue
    perm = None
    while var in made_by:
      eqn = made_by[var]
      if eqn.primitive.name == 'transpose':
        step = tuple(eqn.params['permutation'])
        perm = step if perm is None else tuple(step[i] for i in perm)
      elif eqn.primitive.name not in ('convert_element_type', 'copy', 'copy_p') or len(eqn.invars) != 1:
        perm = None
        break
      var = eqn.invars[0]
      if compat.is_jaxpr_literal(var):
        perm = None
        break
    if perm is not None and var in invars and perm != tuple(range(len(perm))):
      moves[invars[var]] = perm
  return moves
