"""Every call whose spelling depends on the installed jax / flax version.

Flax moved within 0.12.x (`sharding` -> `sharding_names` -> `out_sharding`,
eager sharding of annotated variables on by default, graph vs tree mode) and
jax moved its mesh context managers. Nothing outside this module branches on
a version.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import jax
from flax import nnx
from flax.core import meta


def nnx_param(value: jax.Array, logical_axes: Sequence[str | None]) -> nnx.Param:
  """An NNX parameter annotated with its logical axes.

  Eager sharding is off: placement is decided once, by the jitted
  initialiser's output shardings (bridge.shardings), on both sides alike.
  """
  return nnx.Param(value, **nnx_axes_metadata(logical_axes))


def nnx_axes_metadata(logical_axes: Sequence[str | None]) -> dict[str, Any]:
  """Variable metadata naming a parameter's logical axes, for stock layers'
  `kernel_metadata=` and the like; eager sharding off, as in `nnx_param`."""
  return {'out_sharding': tuple(logical_axes), 'eager_sharding': False}


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


def cache_compiles_of_every_process() -> bool:
  """Lets every process of a multi-process run write jax's persistent cache.

  jax writes cache entries from process 0 only (against write contention on
  shared file systems). On CPU, each process computes its own keys (the
  topology fingerprint in the key differs per process), so a process other
  than 0 never finds an entry and compiles every program on every run while
  process 0, which loaded its programs, waits for it at the first
  collective. For runs whose processes share one machine (and so one cache
  directory with jax's file lock) this wraps jax's private `_cache_write` to
  write from every process, with jax's own checks: no entry for a program
  with host callbacks or compiled faster than the configured minimum.

  Returns False (and changes nothing) where this jax's `_cache_write` is not
  the one this was written against: runs are then only slower.
  """
  import inspect
  import warnings

  from jax._src import compilation_cache, compiler, config, distributed

  original = compiler._cache_write
  if getattr(original, '_parity_every_process', False):
    return True
  signature = inspect.signature(original)
  if list(signature.parameters)[:5] != ['cache_key', 'compile_time_secs', 'module_name', 'backend', 'executable']:
    return False

  def _cache_write(*args, **kwargs):
    if distributed.global_state.process_id == 0:
      return original(*args, **kwargs)
    bound = signature.bind(*args, **kwargs).arguments
    if bound.get('host_callbacks'):
      return None
    if bound['compile_time_secs'] < config.persistent_cache_min_compile_time_secs.value:
      return None
    try:
      compilation_cache.put_executable_and_time(
          bound['cache_key'], bound['module_name'], bound['executable'], bound['backend'],
          int(bound['compile_time_secs']),
      )
    except Exception as e:  # as jax does: a failed write costs a compile later, nothing else
      warnings.warn(f"persistent cache entry for {bound['module_name']!r} not written: {e!r}")
    return None

  _cache_write._parity_every_process = True
  compiler._cache_write = _cache_write
  return True


def fresh_trace() -> Any:
  """A context in which jit traces again instead of reusing a cached trace.

  jit (and `nnx.jit`) keep each function's trace per argument types and
  trace context. Set to a regex that removes nothing, jax's source-file
  canonicalisation (part of the trace context; it touches debug locations
  only) gives another context, so a step lowered in it is traced anew, e.g.
  with its module calls named (parity/compare/scopes.py). A jax._src config state in
  jax 0.10 to 0.12; no public API does this.
  """
  from jax._src import config

  return config.hlo_source_file_canonicalization_regex('(?!)parity-fresh-trace')


@contextlib.contextmanager
def logical_constraint_names() -> Iterator[list[str]]:
  """The logical axis names every `nn.with_logical_constraint` call in the block asks for.

  flax resolves them through the rules inside the call and leaves a name the
  rules do not know unsharded without a word, so a traced program shows no
  trace of it. The private `flax.linen.spmd._with_sharding_constraint_one_fallback`
  (flax 0.12.8 and 0.12.12), through which each call goes, is wrapped to see them.
  """
  from flax.linen import spmd

  seen: list[str] = []
  original = spmd._with_sharding_constraint_one_fallback

  def recording(axis_resources, x, *args, **kwargs):
    seen.extend(name for name in (axis_resources or ()) if isinstance(name, str))
    return original(axis_resources, x, *args, **kwargs)

  spmd._with_sharding_constraint_one_fallback = recording
  try:
    yield seen
  finally:
    spmd._with_sharding_constraint_one_fallback = original


def jax_minor() -> str:
  """jax's `major.minor` (records whose bits a jax release may change are kept per minor version)."""
  return '.'.join(jax.__version__.split('.')[:2])


def is_jaxpr_literal(x: Any) -> bool:
  """Whether a jaxpr operand is a literal constant (`jax.extend.core.Literal`, where jax has it)."""
  try:
    from jax.extend.core import Literal  # pylint: disable=g-import-not-at-top
  except ImportError:  # older jax
    from jax._src.core import Literal  # pylint: disable=g-import-not-at-top
  return isinstance(x, Literal)


def linen_make_rng(root: Any, path: Sequence[str], count: int) -> Any:
  """The key Linen's `make_rng` gives the `count`-th draw (from 1) in the scope at `path`
  of an `apply` given `root` for that collection: flax's own derivation (`LazyRng`),
  so its hashing options (`flax_fix_rng_separator`) apply as they do in Linen."""
  from flax.core import scope

  return scope.LazyRng.create(root, *path, count).as_jax_rng()


@contextlib.contextmanager
def eager_sharding_off() -> Iterator[None]:
  """NNX variables annotated with a sharding (`nnx.with_partitioning`, `out_sharding=`) made
  without placing them: flax 0.12 shards them eagerly by default, which needs a mesh with
  those axis names. The kit places a side's state itself (its `place`), on one device or a mesh."""
  use = getattr(nnx, 'use_eager_sharding', None)
  if use is None:  # a flax without eager sharding
    yield
    return
  with use(False):
    yield


# flax's lifted scan (`nn.scan`, and `nn.RNN` over it) traces its body once more,
# outside the scan, to check that broadcast values are loop invariants
# (flax/core/axes_scan.py, `check_constancy_invariants`): through partial_eval's
# trace_to_jaxpr_* (`nounits` in flax 0.12.8, `dynamic` in 0.12.12). The module
# calls of that pass are not the model's: the kit's recorders skip them.
_SCAN_CHECK_DEPTH = [0]


class _MarkedPartialEval:
  """partial_eval as flax's axes_scan sees it, its trace_to_jaxpr_* counted while they run."""

  def __init__(self, pe: Any):
    self._pe = pe

  def __getattr__(self, name: str) -> Any:
    value = getattr(self._pe, name)
    if not name.startswith('trace_to_jaxpr'):
      return value

    def traced(*args, **kwargs):
      _SCAN_CHECK_DEPTH[0] += 1
      try:
        return value(*args, **kwargs)
      finally:
        _SCAN_CHECK_DEPTH[0] -= 1

    return traced


@contextlib.contextmanager
def scan_check_pass_marked() -> Iterator[None]:
  """While active, `in_scan_check_pass()` tells the body pass Linen's scan makes to check its
  broadcast values apart from the scan's own (a flax without that pass: never)."""
  from flax.core import axes_scan  # pylint: disable=g-import-not-at-top

  original = getattr(axes_scan, 'pe', None)
  if original is None or isinstance(original, _MarkedPartialEval):
    yield
    return
  axes_scan.pe = _MarkedPartialEval(original)
  try:
    yield
  finally:
    axes_scan.pe = original


def in_scan_check_pass() -> bool:
  """True inside the check pass of a Linen scan's body (see `scan_check_pass_marked`)."""
  return _SCAN_CHECK_DEPTH[0] > 0


def eager() -> bool:
  """True outside every jax trace (jit, grad, eval_shape, ...): an operation runs at once there,
  each asking for a program of its own, while inside a trace it joins the traced program."""
  from jax._src import core

  return isinstance(core.trace_ctx.trace, core.EvalTrace)


def current_trace() -> Any:
  """An opaque token of the jax trace now active, equal for the same trace (flax's own check)."""
  import jax.extend

  return jax.extend.core.get_opaque_trace_state(convention='nnx')


@contextlib.contextmanager
def flax_scan_checks() -> Iterator[list[bool]]:
  """While active, the list yielded is non-empty while flax's `nn.scan` traces its body to check
  its broadcast values, the trace before the loop's own whose draws are not the loop's (flax
  `core/axes_scan.py`, `scan_fn`: `pe.trace_to_jaxpr_nounits` in flax 0.12.8,
  `pe.trace_to_jaxpr_dynamic` in 0.12.12, its only calls of either)."""
  from flax.core import axes_scan

  pe = axes_scan.pe
  active: list[bool] = []

  def checking(trace_fn):
    def traced(*args, **kwargs):
      active.append(True)
      try:
        return trace_fn(*args, **kwargs)
      finally:
        active.pop()
    return traced

  class _Checking:
    def __getattr__(self, name):
      value = getattr(pe, name)
      return checking(value) if name in ('trace_to_jaxpr_nounits', 'trace_to_jaxpr_dynamic') else value

  axes_scan.pe = _Checking()
  try:
    yield active
  finally:
    axes_scan.pe = pe


def set_variable_value(variable: nnx.Variable, value: Any) -> None:
  """Replaces a variable's whole value (not an indexed update: no scatter in the program)."""
  if hasattr(variable, 'set_value'):
    variable.set_value(value)
  else:
    variable.value = value


def orbax_empty_or_leaf(x: Any) -> bool:
  """Orbax's own test for where a saved tree stops: a leaf, or an empty node (None, an
  optax `EmptyState()`, `{}`), which Orbax records as a placeholder."""
  try:
    from orbax.checkpoint._src.tree import utils as orbax_tree  # pylint: disable=g-import-not-at-top

    return orbax_tree.is_empty_or_leaf(x)
  except (ImportError, AttributeError):
    children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
    return not children or (len(children) == 1 and children[0] is x)


def orbax_empty_typestr(x: Any) -> str:
  """The `value_type` Orbax writes in `_METADATA` for an empty node of a saved tree."""
  try:
    from orbax.checkpoint._src.metadata import empty_values  # pylint: disable=g-import-not-at-top
    from orbax.checkpoint._src.metadata import pytree_metadata_options  # pylint: disable=g-import-not-at-top

    options = pytree_metadata_options.PYTREE_METADATA_OPTIONS
    if not empty_values.is_supported_empty_value(x, options):
      return 'None'  # as Orbax's get_param_typestr: an optax EmptyState() without rich types
    return empty_values.override_empty_value_typestr(empty_values.get_empty_value_typestr(x, options), options)
  except (ImportError, AttributeError):
    return 'None'


@contextlib.contextmanager
def on_backend_compile(callback: Callable[[str, str, int, float], None]) -> Iterator[None]:
  """Calls `callback(function, fingerprint, devices, seconds)` for each program jax hands XLA in the
  block (compiled, or loaded from the persistent cache): `fingerprint` a digest of the program's
  text, so two requests for the same program are told as such. jax's public monitoring events
  name the function only; this wraps the private `jax._src.compiler.compile_or_get_cached`, which
  every supported jax calls by module attribute (a jax without it: nothing is recorded)."""
  import hashlib
  import time

  from jax._src import compiler

  original = getattr(compiler, 'compile_or_get_cached', None)
  if original is None:
    yield
    return

  def recorded(backend, computation, devices, *args, **kwargs):
    # Read before XLA sees it: compiling may rewrite the module in place (Shardy's export passes).
    try:
      seen = (str(computation.operation.attributes['sym_name']).strip('"'),
              hashlib.sha256(str(computation).encode()).hexdigest()[:12], int(getattr(devices, 'size', 1)))
    except Exception:  # pylint: disable=broad-except  (a diagnostic: never fails a compile)
      seen = None
    start = time.perf_counter()
    out = original(backend, computation, devices, *args, **kwargs)
    if seen is not None:
      callback(*seen, time.perf_counter() - start)
    return out

  compiler.compile_or_get_cached = recorded
  try:
    yield
  finally:
    compiler.compile_or_get_cached = original
