"""What both stock sides share: their steps placed and jitted once, decoding, the state across the checkpoint layout."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import numpy as np

from parity.core import compat
from parity.core import paths
from parity.pairs import adapter


def _decoded(tokens, logits, cache, rename=lambda path: path) -> dict[str, Any]:
  """A `decode_fn`'s result as the decode part takes it: the cache under `cache/`, by Linen path."""
  return {'tokens': tokens, 'logits': logits,
          'cache': {f'cache/{rename(p)}': x for p, x in paths.flatten(cache).items()}}


def named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
  """`fn` under `name`, which jax gives its program (`jit_<name>`): what `--parity-programs` lists."""
  def program(*args, **kwargs):
    return fn(*args, **kwargs)

  program.__name__ = program.__qualname__ = name
  return program


_INITIALISERS: dict[tuple, Callable[[], Any]] = {}  # (side kind, create, stand-ins, seed) -> its program


def _one_program(key: tuple, make: Callable[[], Any], seed: int, what: str) -> Any:
  """`make()` (a side's `create(seed)`, as arrays, unplaced) run as one jitted program: a model's
  initialisers are one compile, not one per eager operation (a small model's eager init asks XLA
  for some 70 programs). Sides of one `create` (a pair's sides on each of its meshes, which place
  the result themselves) share the program by `key`. A `create` that cannot be traced (it reads
  a value on the host) runs eagerly, as written, with a warning saying so."""
  program = _INITIALISERS.get(key)
  if program is None:
    program = _INITIALISERS[key] = jax.jit(named(make, what.replace(' ', '_')))
  try:
    return program()
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
          jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError) as e:
    import warnings

    _INITIALISERS[key] = make
    warnings.warn(f'{what}({seed}) cannot be traced ({type(e).__name__}), so it runs eagerly: one XLA'
                  ' program per operation. A create that jax.jit can trace is one program', stacklevel=3)
    return make()


def _on_device(value: Any) -> jax.Array:
  """`jnp.asarray(value)` as jax would make it (its dtype canonical), put with `device_put`: no XLA
  program per shape, as `jnp.asarray` of a host array asks for one."""
  if isinstance(value, jax.Array):
    return value
  host = np.asarray(value)
  return jax.device_put(host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False))


def _via_host(x: Any) -> Any:
  """A one-device array's value on the host (a typed key array, which has none there, as it is)."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) \
      and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) and len(x.sharding.device_set) == 1:
    return np.asarray(x)
  return x


def _replicated(mesh, tree):
  return jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), tree)


class _Stock:
  """What both stock sides share: placement on a mesh and the checkpoint view."""

  mesh: jax.sharding.Mesh | None
  batch_axis: str
  rules: tuple[tuple[str, Any], ...] | None

  @functools.cached_property
  def state_shardings(self) -> Any:
    """The state's target shardings (a prefix of the state's tree); None off a mesh."""
    if self.mesh is None:
      return None
    if self.rules is None:
      return _replicated(self.mesh, self.template)
    return nn.logical_to_mesh_sharding(self._logical_specs(), self.mesh, self._rule_list)

  @property
  def _rule_list(self) -> list[tuple[str, Any]]:
    """The rules as flax takes them (none: no logical name maps to a mesh axis), and after
    them each mesh axis as itself: a side annotated with mesh axes (its own rules already
    applied) is placed as written."""
    rules = [tuple(r) for r in self.rules or ()]
    logical = {r[0] for r in rules}
    axes = self.mesh.axis_names if self.mesh is not None else ()
    return rules + [(axis, axis) for axis in axes if axis not in logical]

  def batch_sharding(self) -> Any:
    if self.mesh is None:
      return None
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(self.batch_axis))

  def place(self, state: Any) -> Any:
    if self.mesh is None:
      return state
    # From the host: a one-device array put on the mesh as it is asks for a slicing program
    # (`jit__multi_slice`) per shape and sharding; the same bits from the host ask for none.
    return jax.device_put(jax.tree.map(_via_host, state), self.state_shardings)

  def place_batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    sharding = self.batch_sharding()
    if sharding is None:
      return {k: _on_device(v) for k, v in batch.items()}
    ways = self.mesh.shape[self.batch_axis]
    for k, v in batch.items():
      shape = np.shape(v)
      if not shape or shape[0] % ways:
        rows = f'{shape[0]} rows' if shape else 'no batch dimension'
        raise adapter.BatchError(
            f'batch entry {k!r} ({paths.describe(np.asarray(v))}) has {rows}: the mesh\'s {self.batch_axis!r} axis'
            f' splits the batch over {ways} devices, evenly only. Give the pair a batch whose first'
            f' dimension divides by {ways}, or other meshes: Pair(meshes=...), pytest --parity-mesh,'
            f' parity compare --mesh'
        )
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}

  def checkpoint_shardings(self) -> dict[str, Any]:
    return self._checkpoint_leaves(self.state_shardings)

  def abstract_checkpoint(self) -> dict[str, jax.ShapeDtypeStruct]:
    flat = self.to_checkpoint(self.template)
    shardings = self.checkpoint_shardings() if self.mesh is not None else {}
    return {
        p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings.get(p)) for p, x in flat.items()
    }

  def _jit(self, fn, state_out: bool):
    if self.mesh is None:
      return jax.jit(fn)
    out = (self.state_shardings, None) if state_out else None
    return jax.jit(fn, out_shardings=out)

  def train_step(self, state, batch, dropout_base):
    with self._context():
      return self._train_step(state, batch, dropout_base)

  def eval_step(self, state, batch):
    with self._context():
      return self._eval_step(state, batch)

  def value_and_grads(self, state, batch, dropout_key):
    with self._context():
      return self._value_and_grads(state, batch, dropout_key)

  def train_step_function(self):
    return self._train_step

  def lower_train_step(self, state, batch, dropout_base) -> jax.stages.Lowered:
    with self._context():
      return self._train_step.lower(state, batch, dropout_base)

  def tracing_context(self):
    """The context the side's steps are traced in (its mesh and rules), for a trace of its own."""
    return self._context()

  @contextlib.contextmanager
  def _context(self):
    """The mesh (and the rules, if given) while tracing; nothing off a mesh."""
    if self.mesh is None:
      yield
      return
    with compat.use_mesh(self.mesh), nn.logical_axis_rules(self._rule_list):
      yield

  def argument_names(self, lowered, state, batch, dropout_base) -> list[str]:
    return adapter.step_argument_names(lowered, state, batch, self._checkpoint_leaves)

  def eval_outputs(self, state, batch) -> Any:
    """The side's `forward`: the model's eval-mode outputs (None: no `forward` given)."""
    if self._forward is None:
      return None
    with self._context():
      return self._forward(state, batch)

  def eval_and_outputs(self, state, batch) -> tuple[Any, Any] | None:
    """(eval_step's metrics, forward's outputs) from one program, where `forward` is given (None
    otherwise): the eval part reads both, so it compiles one eval program per side, not two."""
    if self._eval_and_forward is None:
      return None
    with self._context():
      return self._eval_and_forward(state, batch)
