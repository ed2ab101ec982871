"""Orbax checkpoints of either side's train state, in the one Linen layout.

A step directory holds two Orbax items, both PyTrees written with OCDBT and
zarr3 (as the seed runs' `CheckpointManager` writes them):

  items   the train state in the Linen checkpoint layout: `step`,
          `params/params/...`, `opt_state/...` (what `side.to_checkpoint`
          returns, nested by '/'); the item name MaxText uses.
  rng     `{'dropout_base': uint32[2]}`: the dropout base key, so a resume
          continues the key stream instead of restarting it.

Both sides write the same layout, so one checkpoint restores into either.
Saves are asynchronous; `restore` waits for pending saves before reading.
Restores ask Orbax for each array directly in the restoring side's target
sharding (`side.abstract_checkpoint()`), so no device ever holds the whole
unsharded state. The saved tree is checked against the side's tree first:
a mismatch raises the bridge's `TreeMismatchError`, naming every path.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from parity.core import paths

ITEMS = 'items'
RNG = 'rng'
DROPOUT_BASE = 'dropout_base'
ITEM_NAMES = (ITEMS, RNG)


class CheckpointError(ValueError):
  """A checkpoint directory or step that cannot be read (one-line message)."""


def _handler() -> ocp.PyTreeCheckpointHandler:
  return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)


def open_manager(
    directory: str | os.PathLike, *, create: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
  """A `CheckpointManager` on `directory` (async saves, OCDBT, zarr3)."""
  directory = os.path.abspath(os.fspath(directory))
  if not create and not os.path.isdir(directory):
    raise CheckpointError(f'no checkpoint directory at {directory}')
  options = ocp.CheckpointManagerOptions(
      create=create,
      read_only=read_only,
      enable_async_checkpointing=True,
  )
  return ocp.CheckpointManager(
      directory,
      options=options,
      item_names=ITEM_NAMES,
      item_handlers={name: _handler() for name in ITEM_NAMES},
  )


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  """`{'a/b': x}` -> `{'a': {'b': x}}` (the tree Orbax writes)."""
  tree: dict[str, Any] = {}
  for path, leaf in flat.items():
    node = tree
    *parents, name = path.split('/')
    for key in parents:
      node = node.setdefault(key, {})
    node[name] = leaf
  return tree


def key_data(dropout_base: Any) -> jax.Array:
  """The base key as raw uint32[2] data (typed keys are unwrapped)."""
  if jnp.issubdtype(dropout_base.dtype, jax.dtypes.prng_key):
    dropout_base = jax.random.key_data(dropout_base)
  if dropout_base.shape != (2,) or np.dtype(dropout_base.dtype) != np.uint32:
    raise ValueError(
        f'dropout base key: expected uint32[2], got {paths.describe(dropout_base)}'
    )
  return dropout_base


def save(
    manager: ocp.CheckpointManager, step: int, side: Any, state: Any, dropout_base: Any
) -> None:
  """Starts an asynchronous save of `state` (of `side`) and its dropout key as `step`.

  Returns once the arrays are copied off the devices; the state may be
  trained on meanwhile. `manager.wait_until_finished()` ends the write.
  """
  items = nest(side.to_checkpoint(state))
  rng = {DROPOUT_BASE: key_data(dropout_base)}
  manager.save(
      step,
      args=ocp.args.Composite(
          **{ITEMS: ocp.args.PyTreeSave(items), RNG: ocp.args.PyTreeSave(rng)}
      ),
      force=True,
  )


def _check_step(manager: ocp.CheckpointManager, step: int) -> None:
  steps = list(manager.all_steps())
  if step not in steps:
    raise CheckpointError(
        f'checkpoint step {step} does not exist in {manager.directory};'
        f' steps there: {sorted(steps) or "none"}'
    )


def saved_arrays(manager: ocp.CheckpointManager, step: int) -> dict[str, dict[str, Any]]:
  """`{item: {path: metadata with .shape and .dtype}}` as saved (nothing read)."""
  manager.wait_until_finished()
  _check_step(manager, step)
  metadata = manager.item_metadata(step)
  out = {}
  for name in ITEM_NAMES:
    try:
      item = metadata[name]
    except KeyError:
      item = None
    if item is None:
      raise CheckpointError(
          f'checkpoint step {step} in {manager.directory} has no {name!r} item'
          f' (this checkpoint layout has {ITEMS!r}: the train state, {RNG!r}: the dropout key)'
      )
    out[name] = paths.flatten(getattr(item, 'tree', item))
  return out


def _one_device() -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _with_shardings(abstract: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
  """Off a mesh a side asks for no sharding; Orbax needs one: the default device."""
  return {
      p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding or _one_device())
      for p, x in abstract.items()
  }


def key_sharding(mesh: jax.sharding.Mesh | None) -> jax.sharding.Sharding:
  """Where a restored dropout key lives: replicated on `mesh`, else the default device."""
  if mesh is None:
    return _one_device()
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _restore_items(manager: ocp.CheckpointManager, step: int, targets: Mapping[str, Any]) -> dict[str, Any]:
  """Each item restored into its tree of ShapeDtypeStructs (shape, dtype, sharding)."""
  return manager.restore(
      step,
      args=ocp.args.Composite(**{
          name: ocp.args.PyTreeRestore(
              item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree)
          )
          for name, tree in targets.items()
      }),
  )


def restore_checkpoint(
    manager: ocp.CheckpointManager, step: int, side: Any
) -> tuple[dict[str, jax.Array], jax.Array]:
  """(`{checkpoint path: array}` in `side`'s checkpoint shardings, dropout base key).

  Raises TreeMismatchError (naming each path) if the saved tree is not the
  one `side` expects, before any array is read.
  """
  saved = saved_arrays(manager, step)
  abstract = _with_shardings(side.abstract_checkpoint())
  paths.check_leaves(
      f'checkpoint step {step} -> {side.name} train state', abstract, saved[ITEMS]
  )
  rng_abstract = {DROPOUT_BASE: jax.ShapeDtypeStruct((2,), np.uint32, sharding=key_sharding(side.mesh))}
  paths.check_leaves(f'checkpoint step {step} -> dropout key', rng_abstract, saved[RNG])
  targets = {ITEMS: nest(abstract), RNG: rng_abstract}
  restored = _restore_items(manager, step, targets)
  return paths.flatten(restored[ITEMS]), restored[RNG][DROPOUT_BASE]


def restore(manager: ocp.CheckpointManager, step: int, side: Any) -> tuple[Any, jax.Array]:
  """(`side`'s train state in its target shardings, dropout base key) from `step`.

  Off a mesh the arrays come back placed as a fresh state is: on the default
  device but not committed to it. Orbax commits them to the device it
  restores onto, and jit compiles a second program for committed arguments
  (the same computation, another cache key): resuming would compile every
  step function again.
  """
  flat, dropout_base = restore_checkpoint(manager, step, side)
  if side.mesh is None:
    flat, dropout_base = _uncommitted((flat, dropout_base))
  return side.from_checkpoint(flat), dropout_base


def _uncommitted(tree: Any) -> Any:
  # jax has no call that uncommits an array; a copy through the host does (exact).
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tree)


def restore_arrays(
    manager: ocp.CheckpointManager, step: int, sharding: jax.sharding.Sharding | None = None
) -> dict[str, dict[str, jax.Array]]:
  """`{item: {path: array}}` of any step as saved, whatever its tree (e.g. a converted one).

  Every array lands in `sharding` (default: the default device).
  """
  saved = saved_arrays(manager, step)
  sharding = sharding or _one_device()
  targets = {
      name: nest({p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding) for p, m in tree.items()})
      for name, tree in saved.items()
  }
  restored = _restore_items(manager, step, targets)
  return {name: paths.flatten(restored[name]) for name in targets}
