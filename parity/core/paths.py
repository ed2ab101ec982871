"""Flat `{path: leaf}` views of pytrees and strict refilling of templates.

A path is the '/'-joined sequence of dict keys, attribute names and sequence
indices, e.g. `decoder/layers/mlp/wi_0/kernel` or `1/0/mu/params/decoder/...`.
NNX Variables and Linen's metadata boxes (`nn.with_logical_partitioning`
parameters, and the optimizer moments optax builds from them) count as
leaves, their value taken, so Linen dicts, boxed or not, NNX States and optax
states all flatten the same way.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from flax.core import meta

from parity.core.errors import Problem, TreeMismatchError
from parity.core import compat


def _is_variable(x: Any) -> bool:
  """An NNX Variable or a Linen metadata box: a leaf whose value is its array."""
  return isinstance(x, (nnx.Variable, meta.AxisMetadata))


def _path_str(path: tuple[Any, ...]) -> str:
  return '/'.join(str(compat.key_value(k)) for k in path)


def items(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
  """`[(path, leaf)]` in tree order, stopping at nodes where `is_leaf` holds."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return [(_path_str(path), leaf) for path, leaf in leaves]


def _value(leaf: Any) -> Any:
  if isinstance(leaf, nnx.Variable):
    return leaf.get_value()
  if isinstance(leaf, meta.Partitioned):
    return leaf.value  # not unbox(): that would also constrain it under a mesh
  if isinstance(leaf, meta.AxisMetadata):
    return leaf.unbox()
  return leaf


def flatten(tree: Any) -> dict[str, Any]:
  """`{path: array}` for every leaf of `tree` (Variables unwrapped)."""
  return {path: _value(leaf) for path, leaf in items(tree, _is_variable)}


def dtype_name(dtype: Any) -> str:
  """A dtype's name: numpy's, or jax's own for an extended dtype (a typed PRNG key: `key<fry>`)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return str(dtype)
  return np.dtype(dtype).name


def describe(x: Any) -> str:
  return f'{dtype_name(x.dtype)}{list(x.shape)}'


def check_leaves(
    what: str,
    expected: Mapping[str, Any],
    got: Mapping[str, Any],
) -> None:
  """Raises TreeMismatchError unless both have the same paths, shapes, dtypes."""
  problems = []
  for path in sorted(set(expected) - set(got)):
    problems.append(Problem(path, 'missing', describe(expected[path]), 'nothing'))
  for path in sorted(set(got) - set(expected)):
    problems.append(Problem(path, 'extra', 'nothing', describe(got[path])))
  for path in sorted(set(expected) & set(got)):
    e, g = expected[path], got[path]
    if tuple(e.shape) != tuple(g.shape):
      problems.append(Problem(path, 'shape', str(list(e.shape)), str(list(g.shape))))
    elif dtype_name(e.dtype) != dtype_name(g.dtype):
      problems.append(Problem(path, 'dtype', dtype_name(e.dtype), dtype_name(g.dtype)))
  if problems:
    raise TreeMismatchError(what, problems)


def fill(what: str, template: Any, flat: Mapping[str, Any]) -> Any:
  """`template` with every leaf replaced by `flat[path]`, strictly.

  The template may hold arrays, ShapeDtypeStructs, NNX Variables or Linen
  metadata boxes (whose type and metadata are kept). Paths, shapes and dtypes must all match:
  nothing is cast, broadcast or dropped.
  """
  check_leaves(what, flatten(template), flat)

  def replace(path, leaf):
    value = flat[_path_str(path)]
    if isinstance(leaf, nnx.Variable):
      return compat.nnx_variable_with_value(leaf, value)
    if isinstance(leaf, meta.AxisMetadata):
      return leaf.replace_boxed(value)
    return value

  return jax.tree_util.tree_map_with_path(replace, template, is_leaf=_is_variable)


def map_paths(
    flat: Mapping[str, Any], rename: Callable[[str], str]
) -> dict[str, Any]:
  """Renames every path; two paths mapping to one is an error."""
  out: dict[str, Any] = {}
  for path, leaf in flat.items():
    new = rename(path)
    if new in out:
      raise TreeMismatchError(
          'path rename', [Problem(new, 'duplicate', 'one source', f'{path} and another')]
      )
    out[new] = leaf
  return out


def data_bytes(x: Any) -> int:
  """The bytes of an array's data, from its shape and dtype (a typed key array: its key data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
