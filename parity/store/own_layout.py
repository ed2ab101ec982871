"""A side's checkpoint in the layout its own save code writes, read off that code.

A codebase's training often saves its state in a tree of its own: an NNX
side in the Linen TrainState's on-disk layout plus an `nnx_aux` subtree of
the RNG streams Linen has no place for, or a Linen side that keeps the whole
variables dict under `params`. A pair declares it with the function that
builds the tree its code hands Orbax (`Pair(saves={'nnx': fn})`, called
with what the side's `create` returns). The kit never guesses that tree: it
traces the function once, abstractly, and reads in the program which leaf of
the side's state lands at which path on disk. A leaf that is not a leaf of
the state (computed, not copied; a cast of an integer counter is allowed) is
refused, naming it: a converter can only move arrays, not recompute them.

The result is a `Layout` of format `<role>-own`, which the converter writes
and reads (parity/store/pair_convert/) like the stock formats.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from parity.store.pair_convert.atomic import ConvertError

# The primitives a saved leaf may pass through on its way from the state: a cast (a counter's
# int32 on disk against NNX's uint32) and the copies jax inserts.
_PASS_THROUGH = ('convert_element_type', 'copy', 'copy_p')


def own_format(role: str) -> str:
  """The format name of a side's own declared layout."""
  return f'{role}-own'


def _created(side: Any, template: Any) -> Any:
  """What the side's `create` returns, built from its state `template` (abstract or traced)."""
  graphdef = getattr(side, 'graphdef', None)
  if graphdef is None:
    return template
  from flax import nnx

  from parity.core import compat

  with compat.eager_sharding_off():
    return nnx.merge(graphdef, template)


def _source_of(jaxpr: Any, var: Any, invars: Mapping[Any, int], what: str) -> tuple[int, bool]:
  """(the state leaf an output comes from, whether it was cast), through casts and copies only."""
  from parity.core import compat

  made_by = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
  cast = False
  while True:
    if compat.is_jaxpr_literal(var):
      raise ConvertError(f'{what} is a constant, not a leaf of the side\'s state')
    if var in invars:
      return invars[var], cast
    eqn = made_by.get(var)
    if eqn is None or eqn.primitive.name not in _PASS_THROUGH or len(eqn.invars) != 1:
      made = 'nothing' if eqn is None else eqn.primitive.name
      raise ConvertError(f'{what} is computed ({made}), not copied from a leaf of the side\'s state: a'
                         ' checkpoint converter moves arrays, it cannot recompute them; declare a save'
                         ' function whose tree holds the state\'s own arrays (a cast of a counter is allowed)')
    cast = cast or eqn.primitive.name == 'convert_element_type'
    var = eqn.invars[0]


def saved_tree(side: Any, role: str, save: Callable[[Any], Any]) -> tuple[Any, list[str]]:
  """(the abstract tree `save` hands Orbax, the native path of each of its array leaves in jax's order).

  `save` is called with what the side's `create` returns, built from its abstract state."""
  import jax

  from parity.core import paths

  if not callable(save):
    raise ConvertError(f'Pair saves[{role!r}]: a function of what the {role} side\'s create returns, got {save!r}')
  template = side.template  # the state as the side trains it (a Linen side's unboxed)
  native_items = paths.items(template, paths._is_variable)
  names = [name for name, _ in native_items]
  leaves, treedef = jax.tree_util.tree_flatten(template)
  if len(leaves) != len(names):
    raise ConvertError(f'the {role} side\'s state flattens to {len(leaves)} arrays but names {len(names)}')

  def traced(*flat):
    return save(_created(side, treedef.unflatten(flat)))

  try:
    closed, shape_tree = jax.make_jaxpr(traced, return_shape=True)(*leaves)
  except ConvertError:
    raise
  except Exception as e:  # the user's function: any error, named with what was being done
    raise ConvertError(f'Pair saves[{role!r}] cannot be traced on the {role} side\'s abstract state:'
                       f' {type(e).__name__}: {e}') from None
  jaxpr = closed.jaxpr
  invars = {v: i for i, v in enumerate(jaxpr.invars)}
  out_paths = [name for name, _ in paths.items(shape_tree)]
  sources = []
  for index, (var, where) in enumerate(zip(jaxpr.outvars, out_paths)):
    source, _ = _source_of(jaxpr, var, invars, f'Pair saves[{role!r}]: leaf {where} of the saved tree')
    sources.append(names[source])
  seen: dict[str, str] = {}
  for where, native in zip(out_paths, sources):
    if native in seen:
      raise ConvertError(f'Pair saves[{role!r}]: leaves {seen[native]} and {where} of the saved tree are both'
                         f' the state\'s {native}: each leaf is saved once')
    seen[native] = where
  return shape_tree, sources


def own_layout(side: Any, role: str, save: Callable[[Any], Any]):
  """The Layout of the tree `save` builds, every leaf named by its state path and checkpoint path."""
  import jax

  from parity.core import compat
  from parity.core import paths
  from parity.store import pair_convert

  pair_convert._needs(side, role)
  tree, sources = saved_tree(side, role, save)
  native = paths.flatten(side.template)
  to_checkpoint = pair_convert.checkpoint_paths(side)
  is_node = lambda x: paths._is_variable(x) or compat.orbax_empty_or_leaf(x)
  leaves, empties, order, position = [], [], [], 0
  for keypath, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]:
    keys = pair_convert._keys(keypath)
    if paths._is_variable(node):
      inner = jax.tree_util.tree_flatten_with_path(node, is_leaf=compat.orbax_empty_or_leaf)[0]
      keys += pair_convert._keys(inner[0][0])
      node = inner[0][1]
    elif node is None or not hasattr(node, 'shape'):
      empties.append((keys, compat.orbax_empty_typestr(node)))
      order.append(keys)
      continue
    name = sources[position]
    position += 1
    typed = jax.dtypes.issubdtype(node.dtype, jax.dtypes.prng_key)
    abstract = node
    if typed:
      abstract = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(node.shape, node.dtype))
    if name not in native:
      raise ConvertError(f'Pair saves[{role!r}]: {name} is not a leaf of the {role} side\'s state')
    leaves.append(pair_convert.Leaf('/'.join(k for k, _ in keys), name, to_checkpoint.get(name),
                                    tuple(abstract.shape), np.dtype(abstract.dtype), keys, typed))
    order.append(keys)
  return pair_convert.Layout(role, own_format(role), tuple(leaves), tuple(empties), tuple(order), tree)
