"""Every call whose spelling depends on the installed jax / flax version.

Flax moved within 0.12.x (`sharding` -> `sharding_names` -> `out_sharding`,
eager sharding of annotated variables on by default, graph vs tree mode) and
jax moved its mesh context managers. Nothing outside this module branches on
a version.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
from flax import nnx
from flax.core import meta


def nnx_param(value: jax.Array, logical_axes: Sequence[str | None]) -> nnx.Param:
  """An NNX parameter annotated with its logical axes.

  Eager sharding is off: placement is decided once, by the jitted
  initialiser's output shardings (bridge.shardings), on both sides alike.
  """
  return nnx.Param(value, out_sharding=tuple(logical_axes), eager_sharding=False)


def nnx_logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
  """The logical axes of an NNX variable, whatever this flax calls them."""
  metadata = variable.get_metadata()
  for key in ('out_sharding', 'sharding_names', 'sharding'):
    if metadata.get(key) is not None:
      return tuple(metadata[key])
  return None


def mesh_is_active() -> bool:
  """True inside a mesh context (activation constraints apply only then)."""
  return meta.global_mesh_defined()


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh) -> Iterator[jax.sharding.Mesh]:
  """Makes `mesh` the context mesh for logical constraints and jit.

  `jax.set_mesh` (not the deprecated `with mesh:`, which flax's constraint
  helpers no longer see) on every supported jax.
  """
  with jax.set_mesh(mesh):
    yield mesh


def make_mesh(
    shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[jax.Device]
) -> jax.sharding.Mesh:
  """A mesh whose axes are all `Auto`: shardings come from annotations and XLA's
  propagation, as with GSPMD. Newer jax defaults to `Explicit` axes, which
  reject logical sharding constraints on activations.
  """
  auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
  return jax.make_mesh(tuple(shape), tuple(axis_names), devices=devices, axis_types=auto)


def key_value(key: Any) -> Any:
  """The plain value of a jax key-path entry (dict key, attribute, index)."""
  for attr in ('key', 'idx', 'name'):
    if hasattr(key, attr):
      return getattr(key, attr)
  return str(key)


def nnx_variable_with_value(variable: nnx.Variable, value: Any) -> nnx.Variable:
  """A copy of `variable` (type and metadata kept) holding `value`."""
  return variable.copy(value)


def kept_argument_indices(lowered: jax.stages.Lowered, num_leaves: int) -> list[int]:
  """Which flattened arguments a lowered program kept (jit drops unused ones).

  jax has no public accessor; its lowering records them under
  `compile_args['kept_var_idx']` (jax 0.10 to 0.12). Without it, every
  argument counts as kept.
  """
  lowering = getattr(lowered, '_lowering', None)
  kept = getattr(lowering, 'compile_args', {}).get('kept_var_idx')
  return sorted(kept) if kept is not None else list(range(num_leaves))
