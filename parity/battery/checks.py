"""The equivalence battery of one declared pair: the checks the plugin turns into tests.

Each `check_*` function takes a `Pair` (parity/pairs/adapter.py) and raises
AssertionError with a bitwise report naming every differing path; they are
plain functions, so a test can call one directly (the plugin's tests are
thin wrappers over them). Runs that several
checks read (a pair's sides, its common start, training trajectories) are
computed once per process (`_runs`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import tempfile
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
from flax import nnx
import numpy as np

from parity.core import compat
from parity.core import paths
from parity.core import specs as specs_lib
from parity.core.errors import TreeMismatchError
from parity.core import rng
from parity.compare import activations
from parity.pairs import adapter
from parity.pairs import correspond
from parity.pairs import dropout as pair_dropout
from parity.pairs import substitutes
from parity.core import bitwise
from parity.store import checkpoints
from parity.procs import distributed
from parity.compare import localize
from parity.compare import placement as placement_lib
from parity.compare import programs
from parity.run import runner


class EarlierFailure(AssertionError):
  """A run a part needs raised already, in the first part that needed it (whose report holds
  the traceback): every later part fails with this one line instead of the same traceback."""


def _raises_once(method):
  """`method` (cached) remembers that it crashed: later calls with the same arguments raise
  `EarlierFailure`, naming the error, instead of running the failing code again. A finding
  (AssertionError) is not remembered: every part that meets it reports it in full."""

  signature = inspect.signature(method)

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    bound = signature.bind(self, *args, **kwargs)
    bound.apply_defaults()  # sides() and sides(None) are one run
    args, kwargs = bound.args[1:], {}
    key = (method.__name__, args)
    failed = self.failures.get(key)
    if failed is not None:
      raise EarlierFailure(failed)
    try:
      return method(self, *args, **kwargs)
    except (EarlierFailure, AssertionError):  # a finding: each part that meets it says it
      raise
    except Exception as e:  # noqa: BLE001 (a crash: remembered, then raised as it was)
      what = ', '.join([repr(a) for a in args] + [f'{k}={v!r}' for k, v in sorted(kwargs.items())])
      first = str(e).splitlines()[0] if str(e) else ''
      self.failures[key] = (
          f'{self.pair.name}: {method.__name__}({what}) raised in an earlier part, whose report'
          f' shows the traceback: {type(e).__name__}{": " + first if first else ""}')
      raise

  return wrapper


class _Runs:
  """What a pair's checks share, computed on first use. A shared run that raises is run once:
  the first part that needs it shows the error, every later one fails in one line."""

  def __init__(self, pair: adapter.Pair):
    self.pair = pair
    self.failures: dict[tuple, str] = {}

  @_raises_once
  @functools.cache
  def sides(self, mesh_spec: str | None = None) -> tuple[adapter.Side, adapter.Side]:
    try:
      mesh = None if mesh_spec is None else self.pair.mesh(mesh_spec)
    except ValueError as e:
      if 'devices, but' not in str(e):  # a malformed spec: its own message says what
        raise
      backend = jax.default_backend()
      where = ('' if backend == 'cpu' else
               f"; jax's default backend here is {backend}: JAX_PLATFORMS=cpu runs the battery"
               f' on the CPU devices, or --parity-mesh gives a mesh of the {backend} devices')
      raise ValueError(
          f'{e}. A mesh spans every device; on the CPU, XLA_FLAGS='
          '--xla_force_host_platform_device_count=N set before jax starts gives N devices'
          f" (the plugin sets it for the first pair's meshes, or --parity-mesh's){where}"
      ) from None
    return adapter.make_pair_sides(self.pair, mesh)

  def side(self, name: str, mesh_spec: str | None = None) -> adapter.Side:
    return dict(zip(('linen', 'nnx'), self.sides(mesh_spec)))[name]

  def batch(self, step: int, split: str = 'train', mesh_spec: str | None = None):
    side = self.sides(mesh_spec)[0]
    return side.place_batch(self.pair.batch(step, split))

  @functools.cache
  def dropout_base(self):
    return rng.base_key(self.pair.seed)

  def step_key(self, step: int) -> jax.Array:
    """The key a train step `step` derives from the run's base key (step 0's made with the base)."""
    return rng.first_step_key(self.pair.seed) if step == 0 else rng.step_key(self.dropout_base(), step, 0)

  @functools.cache
  def structure_mismatch(self) -> str | None:
    """Where the two sides' states differ in the checkpoint layout (None: nowhere)."""
    try:
      adapter.check_structure(self.pair.name, *self.sides())
    except TreeMismatchError as e:
      return str(e)
    return None

  @_raises_once
  @functools.cache
  def start(self, init_side: str, mesh_spec: str | None = None) -> dict[str, Any]:
    """`init_side`'s fresh state in the checkpoint layout."""
    # A state carried to a side of another structure fails inside the side's own code
    # (a KeyError in from_checkpoint): every part that runs a state says why instead.
    mismatch = self.structure_mismatch()
    if mismatch is not None:
      lines = mismatch.splitlines()
      raise AssertionError(
          f'{self.pair.name}: the two sides\' states differ in the checkpoint layout, so nothing is'
          ' compared here (the structure part names every path):\n' + '\n'.join(lines[:4])
          + (f'\n  ... and {len(lines) - 4} more lines' if len(lines) > 4 else ''))
    side = self.side(init_side, mesh_spec)
    return side.to_checkpoint(side.init(self.pair.seed))

  @_raises_once
  @functools.cache
  def trajectory(self, side_name: str, init_side: str, mesh_spec: str | None = None):
    """(train metrics per step, final state in the checkpoint layout, final state) of
    `pair.steps` steps from `init_side`'s init."""
    side = self.side(side_name, mesh_spec)
    state = side.from_checkpoint(self.start(init_side, mesh_spec))
    metrics = []
    for step in range(self.pair.steps):
      state, m = side.train_step(state, self.batch(step, mesh_spec=mesh_spec), self.dropout_base())
      metrics.append(adapter.checked_metrics(self.pair.name, side, 'train_step', m, need_loss=True))
    return metrics, side.to_checkpoint(state), state

  @functools.cache
  def linen_state_before(self, step: int, init_side: str = 'linen',
                         mesh_spec: str | None = None) -> dict[str, Any]:
    """The Linen side's state (checkpoint layout) after `step` train steps from `init_side`'s
    init (on `mesh_spec`'s mesh, where given)."""
    if step == 0:
      return self.start(init_side, mesh_spec)
    side = self.side('linen', mesh_spec)
    state = side.from_checkpoint(self.start(init_side, mesh_spec))
    for s in range(step):
      state, _ = side.train_step(state, self.batch(s, mesh_spec=mesh_spec), self.dropout_base())
    return side.to_checkpoint(state)

  @functools.cache
  def localization(self, step: int = 0, init_side: str = 'linen',
                   mesh_spec: str | None = None) -> localize.Localization:
    """The localizer on train step `step`, both sides from the Linen state before it (on
    `mesh_spec`'s mesh, where given: a divergence seen only there is localised there)."""
    sides = self.sides(mesh_spec)
    lacking = [side.name for side in sides if not hasattr(side, 'probe')]
    if lacking:
      raise adapter.SideError(
          f'{self.pair.name}: the {" and ".join(lacking)} side(s) have no probe (parity.pairs.adapter.Side.probe),'
          ' which the localizer needs: nothing localized')
    return localize.localize_step(
        *sides, self.linen_state_before(step, init_side, mesh_spec), self.batch(step, mesh_spec=mesh_spec),
        self.step_key(step),
    )

  def loss_and_grads(self) -> dict[str, dict[str, Any]]:
    """Each side's loss and parameter gradients at the common start (step 0's batch and key), by
    side name: `{'loss': ..., 'params/...': gradient}`.

    Where both sides are the kit's stock sides (their `value_and_grads` the kit's, differentiating
    the same `loss` their probes trace), these are the probes' own (`localization()`): each side's
    loss and gradients, traced once with its module calls recorded, so the grads part and the
    localizer read one program per side. Otherwise each side's `value_and_grads`, the code a side
    of its own ships.
    """
    sides = self.sides()
    if all(hasattr(side, 'probe') and _stock_value_and_grads(side) for side in sides):
      try:
        probes = self.localization().probes
      except Exception:  # pylint: disable=broad-except  (the localizer part reports it; grads as before)
        probes = None
      if probes is not None and all(getattr(p, 'loss', None) is not None for p in probes):
        return {side.name: {'loss': p.loss, **p.param_grads} for side, p in zip(sides, probes)}
    start, key = self.start('linen'), self.step_key(0)
    out = {}
    for side in sides:
      value, grads = side.value_and_grads(side.from_checkpoint(start), self.batch(0), key)
      out[side.name] = {'loss': value, **grads}
    return out

  def localization_lines(self, step: int = 0, init_side: str = 'linen',
                         metric_diffs: Sequence[bitwise.LeafDiff] = (), part: str = 'train') -> list[str]:
    """The localizer's report on train step `step`; `metric_diffs`, that step's train
    metrics compared, tells a metric returned as another type from a numeric divergence;
    `part`, the failing part ('grads' or 'train'), what agreeing probes leave."""
    try:
      result = self.localization(step, init_side)
    except Exception as e:  # the localizer must never hide the failure it explains
      return [f'localizer failed: {type(e).__name__}: {e}'] + self.parameter_order_lines()
    lines = result.lines() + self.rng_stream_lines(result)
    if result.first(step) is None and part == 'grads':
      lines.append('both passes are bitwise from the same state (each side\'s probe): so the sides\''
                   ' value_and_grads compute otherwise than their probes (their paths, their loss, the'
                   ' key they take), or the gradients differ in dtype or shape only')
      return lines + self.parameter_order_lines()
    if result.first(step) is None:
      if metric_diffs and all(d.kind != 'bits' for d in metric_diffs):
        lines.append(
            f'both passes are bitwise from the same state, and the train metrics of step {step}'
            f' differ in type only ({"; ".join(str(d) for d in metric_diffs)}): the two train'
            ' steps return a metric as another dtype, shape or key, which a bitwise comparison'
            ' counts as a difference whatever its values')
        return lines
      lines.append('both passes are bitwise from the same state: the difference is in what the'
                   ' step does with the gradients (optimizer update, state collections)')
      lines += self.update_lines(step, init_side)
      lines += self.parameter_order_lines()
    return lines

  def rng_stream_lines(self, result: localize.Localization) -> list[str]:
    """A line when the module the localizer names draws dropout masks from an RNG stream the
    NNX model keeps (a dropout of rate above 0 holding one): what the kit does about it and
    what is left. Nothing for a module that draws nothing (an epsilon bug in a norm)."""
    found = result.first()
    side = self.side('nnx')
    if found is None or getattr(side, 'rng_stream_paths', None) is None:  # the stock NNX side's
      return []
    module = found['path']
    if result.forward_unchanged is not None and found['pass'] == 'forward' and _is_dropout(module):
      return [f"{module}: {result.forward_unchanged}'s dropout returned its input unchanged, where the"
              " other side's dropped: it did not draw at all, so the keys are not to blame. Check the"
              " mode each side gives it in this pass (deterministic=, train=, or a model.eval() or"
              " nnx.view left in place)"]
    attention = self.nnx_attention(module)
    if attention is not None:  # its kept stream, if any, draws only where no Rngs comes at the call
      return self.attention_lines(module, attention)
    nnx_module = side.renames.to_nnx(module)
    streams = self.drawing_streams(nnx_module)
    if not streams:
      other = self.drawing_streams(nnx_module, other=True)
      if other:
        named = module if nnx_module == module else f'{module} (NNX {nnx_module})'
        return [f"{named} draws from a stream the NNX model keeps that is forked from another stream"
                f" than 'dropout' ({', '.join(other)}), where Linen's dropout draws make_rng('dropout'):"
                " the kit gives Linen's keys to streams forked from the model's 'dropout' stream only"
                " (or from its 'default' one, where its nnx.Rngs has no 'dropout' stream), and leaves"
                " this one as drawn. Draw it from 'dropout' (nnx.Dropout's default rng_collection, and"
                " the stream of that name of the model's nnx.Rngs), as the Linen side draws"]
      if module.rsplit('/', 1)[-1].startswith(('MultiHeadDotProductAttention', 'SelfAttention')):
        return stock_attention_lines(module, self.stock_attention_modules())  # the NNX module not found
      return self.dropout_scheme_lines(module)
    named = module if nnx_module == module else f'{module} (NNX {nnx_module})'
    where = ', '.join(streams)
    if getattr(side, 'dropout_keys', None) != 'linen':
      return [f"{named} draws its dropout mask from an RNG stream the NNX model keeps ({where}), Linen's"
              " from make_rng('dropout'): their masks cannot be equal. Give the NNX side Linen's keys,"
              " with no change to either model: StockNnx(..., dropout_keys='linen') seeds the streams"
              " the model keeps with the key Linen's apply receives (docs/plugin.md, \"Stock dropout\")"]
    loops = self.rnn_loops(nnx_module)
    if loops:
      return [rnn_loop_line(named, where, *loops[-1])]
    given = pair_dropout.key_at_the_call(module.split('#', 1)[0])
    if given is not None:
      return [f"{named} keeps an RNG stream ({where}) but was called with a key array at the call"
              f" ({given}): a key the NNX model derived itself, which the kit leaves as drawn (it gives"
              " Linen's keys to an nnx.Rngs or stream, passed at the call or kept by the dropout), so"
              " its mask is not Linen's. Let the dropout draw from what it keeps (no key at the call),"
              " or pass it the nnx.Rngs or stream, as the Linen side's make_rng('dropout') draws"]
    return [f"{named} draws from an RNG stream the NNX model keeps ({where}), which the kit seeds with"
            " Linen's keys (dropout_keys='linen'), and still differs: the kit seeds it with the key a"
            " stock Linen step gives its apply, parity.step_key(dropout_base, step, 0) (in the grads"
            " part, the loss's key); a Linen step that derives its key otherwise, or a draw the kit"
            " does not see (jax.random called on the stream's key), gives other masks"]

  def drawing_streams(self, nnx_module: str, other: bool = False) -> list[str]:
    """The NNX paths of the 'dropout' streams kept by dropouts at or under `nnx_module` that draw (a
    rate above 0), in a fresh model of the NNX side; with `other`, of those forked from another
    stream, each with its tag; [] where it has none or cannot tell."""
    side = self.side('nnx')
    try:
      with compat.eager_sharding_off():
        node = side.create(self.pair.seed)[0]
      for name in filter(None, nnx_module.split('/')):
        node = node[int(name)] if name.isdigit() else getattr(node, name)
      held = pair_dropout.other_streams(node) if other else pair_dropout.held_streams(node)
    except Exception:  # pylint: disable=broad-except  (a hint only)
      return []
    return ['/'.join(p for p in (nnx_module, path, 'rngs') if p) + (f" of '{tag}'" if other else '')
            for path, tag in held]

  def rnn_loops(self, nnx_module: str) -> list[tuple[str, Any, Any]]:
    """The `nnx.RNN`s with dropout streams in their cells on the way to `nnx_module`, in a fresh
    model of the NNX side, each with how its loop draws them (`parity.pairs.dropout.rnn_loops`);
    [] where none is or it cannot tell."""
    try:
      with compat.eager_sharding_off():
        model = self.side('nnx').create(self.pair.seed)[0]
      return pair_dropout.rnn_loops(model, nnx_module)
    except Exception:  # pylint: disable=broad-except  (a hint only)
      return []

  def nnx_module_at(self, module: str) -> Any:
    """The NNX side's module at Linen path `module` (a fresh model's, with any declared stand-in
    given: StockNnx `substitutes`), or None (a side of another kind, or no such module)."""
    side = self.side('nnx')
    if not hasattr(side, 'create') or not hasattr(side, 'renames'):
      return None
    try:
      with compat.eager_sharding_off():
        node = getattr(side, '_create', side.create)(self.pair.seed)[0]
      for name in side.renames.to_nnx(module).split('/'):
        node = node[int(name)] if name.isdigit() else getattr(node, name)
    except Exception:  # pylint: disable=broad-except  (a hint only)
      return None
    return node

  def nnx_attention(self, module: str) -> Any:
    """The NNX side's `nnx.MultiHeadAttention` at Linen path `module`, or None."""
    node = self.nnx_module_at(module)
    return node if isinstance(node, nnx.MultiHeadAttention) else None

  def attention_lines(self, module: str, attention: Any) -> list[str]:
    """Why flax's stock attention at `module` differs, and the fix."""
    scheme = getattr(self.side('nnx'), 'dropout_keys', None)
    if attention.dropout_rate and scheme != 'linen':
      return [f"{module} is flax's stock attention with its own dropout (rate {attention.dropout_rate}):"
              " Linen's draws make_rng('dropout') in the attention's scope, NNX's the Rngs given at the"
              " call (or a stream it keeps): their masks cannot be equal. Pass the Rngs at the call and"
              " give the NNX side Linen's keys: StockNnx(..., dropout_keys='linen')"
              ' (docs/plugin.md, "Stock dropout")']
    draws = getattr(self.side('nnx'), 'linen_draws', None)
    if draws is not None and scheme == 'linen':  # a rate on one side only, before any formula
      linen_draws = any(p == module or p.startswith(module + '/') for p in dict(draws))
      if linen_draws != bool(attention.dropout_rate):
        return [f"{module}: the attentions' dropout rates differ: "
                + ("Linen's draws dropout masks in train mode (make_rng('dropout') in its scope), the NNX"
                   " attention's dropout_rate is 0.0" if linen_draws else
                   f"the NNX attention's dropout_rate is {attention.dropout_rate}, Linen's draws no dropout"
                   " mask in train mode")
                + ". Give both attentions the same dropout_rate (a rate is the model's, not a formula's: no"
                  " substitute makes them agree)"]
    if attention.attention_fn is nnx.dot_product_attention and not attention.dropout_rate:
      return stock_attention_lines(module, self.stock_attention_modules())
    return []  # Linen's formula: given as attention_fn, or flax's own with a dropout rate above 0

  def stock_attention_modules(self) -> list[str]:
    """The Linen paths of the NNX side's `nnx.MultiHeadAttention` modules left with flax's default
    `attention_fn` (an abstract fresh model's): what an in-place substitution declares."""
    side = self.side('nnx')
    if not hasattr(side, 'create') or not hasattr(side, 'renames'):
      return []
    try:
      with compat.eager_sharding_off():
        graph = nnx.eval_shape(lambda: getattr(side, '_create', side.create)(self.pair.seed))
      found = substitutes.instances(graph, substitutes.linen_attention)
    except Exception:  # pylint: disable=broad-except  (a hint only)
      return []
    return [side.renames.to_linen(p.split('/', 1)[1]) for p, state in found.items()
            if state == 'stock' and p.startswith('0/')]

  def dropout_scheme_lines(self, module: str) -> list[str]:
    """Which key scheme each side's dropout uses, when the first differing module is a dropout."""
    scheme = getattr(self.side('nnx'), 'dropout_keys', None)  # the stock NNX side's
    if scheme is None or not module.rsplit('/', 1)[-1].lower().startswith('dropout'):
      return []
    if scheme == 'nnx':
      return [f"{module} is a dropout: stock Linen draws make_rng('dropout') (the module's scope path"
              " and call count folded into the key given to apply), stock NNX draws from the nnx.Rngs"
              " passed at the call (a count folded into the stream's key): their masks cannot be"
              " equal. Give the NNX side Linen's keys, with no change to either model:"
              " StockNnx(..., dropout_keys='linen') (docs/plugin.md, \"Stock dropout\")"]
    return [f"{module} is a dropout and the NNX side already draws Linen's make_rng keys for an"
            " nnx.Rngs passed at the call (dropout_keys='linen'): this call draws otherwise (a key"
            " array passed at the call that is not Linen's, or a key derived by the model itself);"
            " derive it from the step on both sides, or pass the Rngs at the call"]

  def update_lines(self, step: int, init_side: str = 'linen') -> list[str]:
    """Where the two states part after train step `step`, both from the Linen state before it:
    the parts of the state that differ (leaf counts), scalars first named, as a counter
    (a gradient-accumulation step, an EMA count) tells the most."""
    try:
      start = self.linen_state_before(step, init_side)
      after = []
      for side in self.sides():
        state, _ = side.train_step(side.from_checkpoint(start), self.batch(step), self.dropout_base())
        after.append(distributed.host_arrays(side.to_checkpoint(state)))
    except Exception as e:  # a hint only: never hide the failure it explains
      return [f'(states after the step not compared: {type(e).__name__}: {e})']
    diffs = bitwise.compare_trees(*after)
    if not diffs:
      return []
    parts: dict[str, int] = {}
    for d in diffs:
      key = '/'.join(d.path.split('/')[:2])
      parts[key] = parts.get(key, 0) + 1
    shown = ', '.join(f'{k} ({n})' for k, n in list(parts.items())[:8])
    more = f' and {len(parts) - 8} more' if len(parts) > 8 else ''
    scalars = [str(d) for d in diffs if _is_scalar(d, after[0])][:3]
    return [f'after step {step}, from the same state, the states differ in {len(diffs)} leaves:'
            f' {shown}{more}' + (f'; scalars: {"; ".join(scalars)}' if scalars else '')]

  def parameter_order_lines(self) -> list[str]:
    """Where the sides flatten their parameters in different orders, a line saying so.

    A reduction over every leaf (optax.clip_by_global_norm, a global-norm
    metric) adds the leaves in the tree's order, so two sides holding the same
    parameters in another order round differently. The orders are the
    compiled train steps' arguments, named by checkpoint path.
    """
    try:
      names = [self.compiled(s).argument_names or [] for s in ('linen', 'nnx')]
    except Exception as e:  # a hint only: never hide the failure it explains
      return [f'(parameter order not compared: {type(e).__name__}: {e})']
    common = set(names[0]) & set(names[1])
    orders = [[n for n in side if n.startswith('params/') and n in common] for side in names]
    for i, (a, b) in enumerate(zip(*orders)):
      if a != b:
        return [f'the sides flatten their parameters in different orders (parameter {i}: Linen'
                f' {a}, NNX {b}): a reduction over every leaf, such as optax.clip_by_global_norm'
                ' or a global-norm metric, adds them in another order and rounds differently.'
                ' Both frameworks flatten by sorted names: NNX attribute names that sort as the'
                ' Linen module names do make the two sums the same']
    return []

  @_raises_once
  @functools.cache
  def compiled(self, side_name: str) -> runner.CompiledStep:
    side = self.side(side_name)
    state = side.from_checkpoint(self.start('linen'))
    return runner.compile_step(side, state, self.batch(0), self.dropout_base())


def _stock_value_and_grads(side: adapter.Side) -> bool:
  """Whether `side.value_and_grads` is the stock sides' (parity/pairs/stock.py), directly or
  through a wrapper that delegates to one."""
  from parity.pairs import stock

  return getattr(getattr(side, 'value_and_grads', None), '__func__', None) is stock._Stock.value_and_grads


@functools.cache
def _runs(pair: adapter.Pair) -> _Runs:
  return _Runs(pair)


def _battery_frames_hidden(excinfo) -> bool:
  """pytest's `__tracebackhide__` filter for the checks: a failure's frames inside the
  battery are not shown (its message names what differs); a crash's are."""
  return excinfo.errisinstance(AssertionError)


_MEASURED = '\x00measured\x00'  # filled in once every leaf under a declaration is measured


def compare(pair: adapter.Pair, pass_name: str, a: Mapping[str, Any], b: Mapping[str, Any], what: str,
            labels: tuple[str, str] = ('Linen', 'NNX')) -> list[str]:
  """Bitwise, except declared differences, which must hold their bound.

  Returns one line per declared difference seen (with its measured ULP);
  raises AssertionError listing everything else that differs.
  """
  __tracebackhide__ = _battery_frames_hidden
  seen, problems = [], []
  measured: dict[int, int] = {}  # the largest difference under each declaration, by id
  a, b = paths.flatten(dict(a)), paths.flatten(dict(b))
  for d in _scalars_first(bitwise.compare_trees(a, b, labels), a):
    known = pair.known(d.path, pass_name) if d.kind == 'bits' else None
    if known is None:
      problems.append(str(d))
      continue
    ulp = bitwise.ulp_distance(a[d.path], b[d.path])
    if ulp is None:  # not floats: a bound in ULP does not cover it
      problems.append(f'{d} (declared bound {known.max_ulp} ULP, but these are not floats)')
      continue
    measured[id(known)] = max(measured.get(id(known), 0), ulp)
    line = f'{d.path}: {ulp} ULP (declared bound {known.max_ulp}, measured maximum {_MEASURED}: {known.reason})'
    (seen if ulp <= known.max_ulp else problems).append((line, id(known)))
  seen = [line.replace(_MEASURED, f'{measured[k]} ULP') for line, k in seen]
  problems = [p if isinstance(p, str) else p[0].replace(_MEASURED, f'{measured[p[1]]} ULP') for p in problems]
  refused = [line for known in pair.known_differences if pass_name in known.value_passes
             for line in known.refusals(pass_name, measured.get(id(known), 0))]
  if problems:
    more = [f'... and {len(problems) - 50} more'] if len(problems) > 50 else []
    raise AssertionError(
        f'{pair.name}: {what} are not bit-identical: {len(problems)} leaf/leaves differ,'
        f' scalars first (values: {labels[0]} vs {labels[1]})'
        + (f'; and {len(refused)} refusal(s) of the declared bounds, last' if refused else '') + '\n  '
        + '\n  '.join(problems[:50] + more + refused) + _uncovered_lines(pair, pass_name)
    )
  if refused:  # no leaf differs beyond the declarations: the declarations are what fails
    under = (f'the leaves under them differ within the bounds declared: {"; ".join(seen[:3])}'
             + (f'; ... and {len(seen) - 3} more' if len(seen) > 3 else '')) if seen else 'no leaf differs'
    raise RefusedDeclaration(
        f'{pair.name}: {what}: a declared difference is refused ({under}): {refused[0]}'
        + ''.join(f'\n  {line}' for line in refused[1:]))
  return seen


def _uncovered_lines(pair: adapter.Pair, pass_name: str) -> str:
  """For a part that fails: each declared value bound that does not cover its pass, said so (its
  substitute runs in the substitution part alone), with the route that runs every part with
  Linen's formula where the bound is on flax's stock attention."""
  out = []
  for known in pair.known_differences:
    if not known.value_passes or pass_name in known.value_passes or substitutes.in_place(known.substitute):
      continue
    line = (f'\n(declared: {known.describe()} bounds {", ".join(repr(p) for p in known.value_passes)} only, so it'
            f' covers nothing in this part ({pass_name!r}), where the difference reaches too; its substitute runs'
            ' in the substitution part alone')
    if any(p.rsplit('/', 1)[-1].startswith(('MultiHeadDotProductAttention', 'SelfAttention')) for p in known.paths):
      line += ('. For flax\'s stock attention, declare substitute=parity.linen_attention instead (no bound):'
               ' the kit then gives the NNX model Linen\'s formula in every part (docs/plugin.md, "Stock'
               ' attention")')
    out.append(line + ')')
  return ''.join(out)


class RefusedDeclaration(AssertionError):
  """A part fails on a declared bound it refuses (global, unproven, loose, vacuous), with no leaf
  differing beyond the declarations: the headline says so, and no localizer runs."""


def _is_scalar(d: bitwise.LeafDiff, a: Mapping[str, Any]) -> bool:
  """Whether `d` is a leaf of both sides that is a scalar in `a` (the first side's flat tree)."""
  return d.kind not in ('missing', 'extra') and np.ndim(a[d.path]) == 0


def _scalars_first(diffs: list[bitwise.LeafDiff], a: Mapping[str, Any]) -> list[bitwise.LeafDiff]:
  """`diffs` with leaves missing on a side and scalars first (a step counter, a loss: one
  differing scalar often explains every array after it), in path order within each."""
  return sorted(diffs, key=lambda d: 0 if d.kind in ('missing', 'extra') else 1 if _is_scalar(d, a) else 2)


def _with_localization(
    pair: adapter.Pair, error: AssertionError, step: int = 0, init_side: str = 'linen',
    metric_diffs: Sequence[bitwise.LeafDiff] = (), part: str = 'train',
) -> AssertionError:
  if isinstance(error, RefusedDeclaration):  # nothing differs beyond the declarations: nothing to localize
    return error
  lines = _runs(pair).localization_lines(step, init_side, metric_diffs, part)
  # The finding right after the headline, before the leaves that differ (a list to scroll).
  head, _, leaves = str(error).partition('\n')
  return AssertionError(f'{head}\nlocalizer (step {step}, train mode):\n  ' + '\n  '.join(lines)
                        + (f'\n{leaves}' if leaves else ''))


def per_step(metrics: list[Mapping[str, Any]]) -> dict[str, Any]:
  """Each step's train metrics as `<metric>/step_<i>` leaves (the loss and any other the step returns)."""
  return {f'{k}/step_{i}': x for i, m in enumerate(metrics) for k, x in m.items()}


def first_divergent_step(a: list[Mapping[str, Any]], b: list[Mapping[str, Any]]) -> int:
  """The first step whose train metrics differ (shape, dtype or bits); the last step when none do.

  (Equal metrics and an unequal final state: the last step's update differs,
  or an earlier one's without reaching a later metric.)
  """
  for step, (x, y) in enumerate(zip(a, b)):
    if bitwise.compare_trees(dict(x), dict(y)):
      return step
  return len(a) - 1


def check_structure(pair: adapter.Pair) -> None:
  __tracebackhide__ = _battery_frames_hidden
  try:
    adapter.check_structure(pair.name, *_runs(pair).sides())
  except TreeMismatchError as e:
    raise AssertionError('\n'.join([str(e), *renamed_parameters(e.problems)])) from None


def renamed_parameters(problems: Sequence[Any]) -> list[str]:
  """The fix where a parameter a module holds itself (`self.param`, an `nnx.Param` attribute) is
  named otherwise on each side: one missing and one extra path under the same module, of the same
  shape and dtype. The module correspondences pair modules, not the parameters they own."""
  missing, extra = {}, {}
  for problem in problems:
    if problem.path.startswith('params/') and problem.kind in ('missing', 'extra'):
      parent, leaf = problem.path.rsplit('/', 1)
      table = missing if problem.kind == 'missing' else extra
      what = problem.expected if problem.kind == 'missing' else problem.got
      table.setdefault((parent, what), []).append(leaf)
  pairs = [(parent, linen[0], extra[parent, what][0]) for (parent, what), linen in sorted(missing.items())
           if len(linen) == 1 and len(extra.get((parent, what), ())) == 1]
  if not pairs:
    return []
  named = ', '.join(f'{parent}/{a} (NNX: {b})' for parent, a, b in pairs)
  top = [(a, b) for parent, a, b in pairs if parent == 'params']  # the model's own: no module renamed
  fix = (f'renames=parity.Renames(({", ".join(f"({a!r}, {b!r})" for a, b in top)},))' if len(top) == len(pairs)
         else 'a parity.Renames entry from each Linen path to the NNX one (the module path as the NNX'
              ' side names it: `parity renames --pair FILE.py:NAME` prints the table to extend)')
  return [
      f'parameters named otherwise on each side, of one shape and dtype under one module: {named}. If'
      f' they are the same parameters, rename them on the NNX side: {fix} (model_pair:'
      " nnx_options={'renames': ...}; a StockNnx: renames=...). A rename maps whole path components,"
      ' a parameter\'s name included; the module correspondences pair modules, not the parameters a'
      ' module holds itself']


@contextlib.contextmanager
def _as_failure():
  """The bridge's TreeMismatchError (every differing path) as the check's failure: an
  AssertionError with the same message, shown without the bridge's frames."""
  try:
    yield
  except TreeMismatchError as e:
    raise AssertionError(str(e)) from None


def check_specs(pair: adapter.Pair) -> list[str]:
  """Logical specs of the parameters, and of every activation constraint of the train steps.

  The activation constraints are read from each side's traced train step
  (parity/compare/activations.py: traced under a mesh named by the rules' logical
  names, so each constraint spells the names it was given): the same
  number, in the same program order and control flow, with the same shapes,
  dtypes and logical names. The model methods applying them may be named
  differently on each side; a constraint that differs is named by the module
  it is in. Returns a line saying how many were compared.
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  linen, nnx_side = runs.sides()
  notes = check_param_specs(pair, linen, nnx_side)
  if pair.activations_resolved:  # declared: no logical names to read, the physical specs compared
    return notes + _check_resolved_activations(pair, None)
  start = runs.start('linen')
  tables = activation_tables(pair, (linen, nnx_side), [side.from_checkpoint(start) for side in (linen, nnx_side)],
                             runs.batch(0), runs.dropout_base())
  return notes + check_activation_tables(pair, tables)


def activation_tables(pair: adapter.Pair, sides: Sequence[adapter.Side], states: Sequence[Any], batch: Any,
                      dropout_base: Any, mesh_sizes: Mapping[str, int] | None = None) -> tuple[list, list]:
  """Both train steps' activation constraints under the pair's rules (inputs may be abstract)."""
  # `mesh_sizes`: their physical specs on a mesh of those sizes too. A model that constrains
  # with mesh axes fails, saying how to declare it.
  rules = _rules(pair, sides[0], default=specs_lib.DEFAULT_RULES)
  try:
    return tuple(activations.rows(side, state, batch, dropout_base, tuple(rules), mesh_sizes=mesh_sizes)
                 for side, state in zip(sides, states))
  except ValueError as e:
    if 'not found in mesh' not in str(e):
      raise
    raise AssertionError(
        f'{pair.name}: activation constraints name mesh axes, not logical names ({e}): the model'
        ' resolves its names itself. Declare it, Pair(activations_resolved=True), to compare the'
        ' physical specs they resolve to on each mesh of the pair') from None


def check_activation_tables(pair: adapter.Pair, tables: Sequence[list]) -> list[str]:
  """The specs part's verdict on both sides' activation constraints: a line, or AssertionError."""
  # Each constraint that differs is named by its module; constraints with no logical name go
  # to `_check_resolved_activations`.
  problems = activations.drift(*tables, sites=False)
  if problems:
    raise AssertionError(
        f'{pair.name}: activation constraints differ ({len(tables[0])} in Linen\'s train step,'
        f' {len(tables[1])} in NNX\'s):\n  ' + '\n  '.join(problems[:50])
    )
  if not tables[0]:
    return ['activation constraints: none in either train step (nothing to compare)']
  if activations.unnamed(tables[0]) and activations.unnamed(tables[1]):
    return _check_resolved_activations(pair, len(tables[0]))
  return [f'activation constraints: {len(tables[0])} per train step, the same logical names on both sides']


def _check_resolved_activations(pair: adapter.Pair, count: int | None) -> list[str]:
  """Constraints that carry no logical name on either side: never a silent pass. Declared
  (`Pair(activations_resolved=True)`), their physical specs are compared on each mesh."""
  if not pair.activations_resolved:
    raise AssertionError(
        f'{pair.name}: nothing compared: the {count} activation constraints of each train step carry'
        ' no logical name on either side (the model resolves its names to mesh axes before it'
        ' constrains, or constrains with mesh axes), so a renamed activation axis would go unseen.'
        ' Constrain with logical names (nn.with_logical_constraint under the rules), or declare'
        ' that the model resolves them itself, Pair(activations_resolved=True): the part then'
        ' compares the physical specs they resolve to on each mesh of the pair')
  lines = []
  for spec in pair.meshes:
    tables = resolved_activation_tables(pair, spec)
    problems = activations.drift(*tables, sites=False)
    if problems:
      raise AssertionError(
          f'{pair.name}: activation constraints resolve to other mesh axes on {spec} (the model'
          f' resolves its names itself: Pair(activations_resolved=True)):\n  ' + '\n  '.join(problems[:50]))
    if not tables[0]:
      raise AssertionError(f'{pair.name}: nothing compared: no activation constraint in either train'
                           f' step on {spec}, though the pair declares activations_resolved')
    lines.append(f'activation constraints: {len(tables[0])} per train step, resolved by the model itself'
                 f' (declared), the same physical specs on {spec}')
  return lines


def resolved_activation_tables(pair: adapter.Pair, spec: str) -> tuple[list, list]:
  """Both train steps' activation constraints as each side's own mesh (`spec`) and rules resolve them."""
  sides = adapter.make_pair_sides(pair, pair.mesh(spec))
  start = sides[0].init(pair.seed)
  batch = sides[0].place_batch(pair.batch(0, 'train'))
  base = rng.base_key(pair.seed)
  return tuple(activations.physical_rows(side, side.from_checkpoint(sides[0].to_checkpoint(start)), batch, base)
               for side in sides)


def check_param_specs(pair: adapter.Pair, linen: adapter.Side, nnx_side: adapter.Side) -> list[str]:
  """The parameters' annotations, equal as written; or, where one side annotates with logical
  names and the other with mesh axes (already resolved by its own rules), equal in placement
  on every mesh of the pair. Returns a line saying which."""
  linen_specs, nnx_specs = linen.param_specs(), nnx_side.param_specs()
  problems = specs_lib.spec_drift(linen_specs, nnx_specs, f'{pair.name} parameters')
  if not problems:
    return []
  rules = tuple(tuple(r) for r in (_rules(pair, linen, default=()) or ()))
  meshes = {m: specs_lib.parse_mesh_spec(m) for m in pair.meshes}
  axes = sorted(set().union(*meshes.values())) if meshes else []
  kinds = (specs_lib.convention(linen_specs, rules, axes), specs_lib.convention(nnx_specs, rules, axes))
  same_paths = set(linen_specs) == set(nnx_specs)
  if not same_paths or kinds[0] == kinds[1] or 'mixed' in kinds or not meshes:
    # With no rules, a name that is no mesh axis reads as nothing: logical names, with the rules missing.
    unread = [sorted({name for spec in side.values() for entry in spec
                      for name in (entry if isinstance(entry, (tuple, list)) else (entry,))
                      if name is not None} - set(axes)) if not rules else []
              for side in (linen_specs, nnx_specs)]
    shown = [f'logical names ({", ".join(names)}), but no rules were given to read them' if names else kind
             for kind, names in zip(kinds, unread)]
    advice = ('; give the pair the logical axis rules the annotations are written against:'
              ' parity.Pair(..., rules=RULES) (the stock sides take rules= too; docs/plugin.md,'
              ' "Meshes and logical axis rules")') if any(unread) else ''
    raise AssertionError(str(TreeMismatchError(f'{pair.name} parameters specs differ between Linen and NNX'
                                               f' (Linen annotates with {shown[0]}, NNX with {shown[1]}{advice})',
                                               problems)))
  drift = specs_lib.placement_drift(linen_specs, nnx_specs, kinds, rules, meshes)
  if drift:
    raise AssertionError(str(TreeMismatchError(
        f'{pair.name} parameters are placed otherwise (Linen annotates with {kinds[0]}, NNX with'
        f' {kinds[1]}; each read in its own convention with the pair\'s rules)', drift)))
  return [f'parameter specs: Linen annotates with {kinds[0]}, NNX with {kinds[1]}; the placements agree'
          f' on {", ".join(meshes)} ({len(linen_specs)} parameters)']


def _rules(pair: adapter.Pair, side: adapter.Side, default):
  """The pair's logical axis rules, else the side's, else `default`."""
  if pair.rules is not None:
    return pair.rules
  return getattr(side, 'rules', None) or default


def check_grads(pair: adapter.Pair) -> list[str]:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  start = runs.start('linen')
  out = runs.loss_and_grads()
  # Gradients that leave parameters out compare the loss alone there, and pass.
  params = sorted(p for p in start if p.startswith('params/'))
  for name in ('linen', 'nnx'):
    uncovered = [p for p in params if p not in out[name]]
    if uncovered:
      raise AssertionError(
          f'{pair.name}: the {name} side\'s value_and_grads gives no gradient for {len(uncovered)} of the'
          f' {len(params)} parameters ({", ".join(uncovered[:4])}{", ..." if len(uncovered) > 4 else ""}):'
          ' their gradients would not be compared. It returns (loss, {path: gradient}) for every'
          ' parameter, in the checkpoint layout (params/...)')
  try:
    found = compare(pair, 'grads', out['linen'], out['nnx'], 'loss and gradients')
  except AssertionError as e:
    raise _with_localization(pair, e, part='grads') from None
  a, b = (distributed.host_arrays(paths.flatten({k: x for k, x in out[s].items() if k != 'loss'}))
          for s in ('linen', 'nnx'))
  zero = [p for p in sorted(a) if p in b and np.size(a[p]) and not np.any(a[p]) and not np.any(b[p])]
  return found + _unproven_line(zero, 'whose gradient is exactly zero on both sides (step 0; the train'
                                ' part names those no train step moves)')


def _unproven_line(params: Sequence[str], what: str) -> list[str]:
  """A note naming the parameters the numbers did not prove (none: no line)."""
  if not params:
    return []
  shown = ', '.join(params[:20]) + (f', ... and {len(params) - 20} more' if len(params) > 20 else '')
  return [f'not proven by values: {len(params)} parameter(s) {what}: a bug in what computes them, or in'
          f' what they feed, changes no number compared here ({shown})']


def check_train(pair: adapter.Pair, init_side: str) -> list[str]:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  (ma, fa, _), (mb, fb, _) = (runs.trajectory(s, init_side) for s in ('linen', 'nnx'))
  try:
    found = compare(pair, 'train', {**per_step(ma), **fa}, {**per_step(mb), **fb},
                    f'{pair.steps} train steps from {init_side} init (train metrics, final state)')
  except AssertionError as e:
    step = first_divergent_step(ma, mb)
    metric_diffs = bitwise.compare_trees(dict(ma[step]), dict(mb[step]))
    raise _with_localization(pair, e, step, init_side, metric_diffs) from None
  start = runs.start(init_side)
  params = [p for p in sorted(start) if p.startswith('params/') and p in fa and p in fb]
  start, a, b = (distributed.host_arrays({p: f[p] for p in params}) for f in (start, fa, fb))
  still = [p for p in params if bitwise.compare_leaves(p, start[p], a[p]) is None
           and bitwise.compare_leaves(p, start[p], b[p]) is None]
  return found + _unproven_line(still, f'that {pair.steps} train step(s) leave bit for bit as they started, on'
                                ' both sides (their gradients zero on every step, or the optimizer leaves them)')


# The init part's bound: the two sides draw their random initialisers from different
# keys (Linen folds module paths into the key, NNX counts a stream), so random leaves
# are compared in distribution, at 6 standard errors (a false alarm about 1e-9 per leaf).
INIT_SIGMAS = 6


def check_init(pair: adapter.Pair) -> None:
  """Each side's own initial state (`init(pair.seed)`, checkpoint layout) against the other's.

  The rest of the battery starts both sides from one state, so a different
  initialiser passes it. Here every leaf that is not random on both sides
  (zeros, ones, a step counter: all its elements equal on either side, or
  not floats) must be bitwise equal; a leaf random on both sides, with n
  elements of standard deviation s, must agree in distribution:
  |mean_linen - mean_nnx| <= 6 s sqrt(2/n) and |std_linen / std_nnx - 1| <= 6/sqrt(n),
  6 standard errors of the difference. A wrong scale (fan-out for fan-in, a
  forgotten 1/sqrt(d)) is caught where it moves the std by more than 6/sqrt(n)
  (0.19 for 1,000 elements, 0.06 for 10,000); initialisers of one variance
  but another shape (uniform against truncated normal) are not told apart.
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  a = distributed.host_arrays(runs.start('linen'))
  b = distributed.host_arrays(runs.start('nnx'))
  problems = []
  for d in bitwise.compare_trees(a, b):
    if d.kind != 'bits':
      problems.append(str(d))
      continue
    x, y = a[d.path], b[d.path]
    random = [
        jax.numpy.issubdtype(v.dtype, jax.numpy.floating) and v.size > 1 and bool(np.any(v != v.flat[0]))
        for v in (x, y)
    ]
    if not all(random):
      which = ' and '.join(name for name, r in zip(('Linen', 'NNX'), random) if not r)
      problems.append(f'{d} (not random in {which}: all its elements equal, or not floats, so'
                      ' compared bit for bit)')
      continue
    x, y = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    n, sx, sy = x.size, x.std(), y.std()
    mean_bound = INIT_SIGMAS * max(sx, sy) * np.sqrt(2 / n)
    std_bound = INIT_SIGMAS / np.sqrt(n)
    stats = (f'mean {x.mean():.4g} vs {y.mean():.4g}, std {sx:.4g} vs {sy:.4g}, {n} elements;'
             f' bounds: means within {mean_bound:.3g}, std ratio within 1 +- {std_bound:.3g}')
    if abs(x.mean() - y.mean()) > mean_bound or abs(sx / sy - 1) > std_bound:
      problems.append(f'{d.path}: another distribution ({stats})')
  if problems:
    raise AssertionError(
        f'{pair.name}: the two sides\' own initial states (init(seed {pair.seed}), checkpoint'
        f' layout) differ beyond what their random initialisers explain: {len(problems)}'
        ' leaf/leaves (values: Linen vs NNX)\n  ' + '\n  '.join(problems[:50])
        + (f'\n  ... and {len(problems) - 50} more' if len(problems) > 50 else '')
    )


def check_eval(pair: adapter.Pair) -> list[str]:
  """The eval steps, first from one state (the Linen run's, carried to NNX), so that a
  difference there is the eval steps' own; then each from its side's own training, which
  also reads what the checkpoint layout leaves out (state only NNX keeps)."""
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  batch = runs.batch(0, 'eval')
  _, trained, linen_state = runs.trajectory('linen', 'linen')
  linen_side, nnx_side = runs.sides()

  def checked(side, metrics):
    return adapter.checked_metrics(pair.name, side, 'eval_step', metrics, need_loss=False)

  def evaluated(side, state):
    """(metrics, outputs): from one program where the side gives both at once (`eval_and_outputs`)."""
    both = getattr(side, 'eval_and_outputs', lambda *a: None)(state, batch)
    if both is not None:
      return checked(side, both[0]), both[1]
    return checked(side, side.eval_step(state, batch)), getattr(side, 'eval_outputs', lambda *a: None)(state, batch)

  def evaluate(side, state):
    return evaluated(side, state)[0]

  nnx_from_linen = nnx_side.from_checkpoint(trained)
  (linen_metrics, linen_outputs), (nnx_metrics, nnx_outputs) = (
      evaluated(side, state) for side, state in ((linen_side, linen_state), (nnx_side, nnx_from_linen)))
  outputs = [linen_outputs, nnx_outputs]
  if (outputs[0] is None) != (outputs[1] is None):
    raise AssertionError(f'{pair.name}: one side gives its eval-mode outputs (`forward`), the other does'
                         ' not: give both, so that the outputs are compared, or neither')
  notes = ['eval-mode outputs: not compared (give both sides `forward=`: a metric can round a'
           ' difference in the outputs away)'] if outputs[0] is None else []
  failures = []  # the outputs' and the metrics' from one state, both compared before either is reported

  def compared(*args) -> list[str]:
    try:
      return compare(pair, 'eval', *args)
    except RefusedDeclaration:  # nothing differs beyond the declarations: nothing to localize
      raise
    except AssertionError as e:
      failures.append(str(e))
      return []

  if outputs[0] is not None:
    notes = compared({'outputs': outputs[0]}, {'outputs': outputs[1]},
                     f'eval-mode outputs from one state (the Linen run\'s after {pair.steps} steps)')
  seen = notes + compared(linen_metrics, nnx_metrics,
                          f'eval metrics from one state (the Linen run\'s after {pair.steps} steps)')
  if failures:
    located = _eval_localized(runs, (linen_side, nnx_side), (linen_state, nnx_from_linen), batch)
    raise AssertionError('\n  '.join(['\n'.join(failures)] + located)) from None
  *_, nnx_state = runs.trajectory('nnx', 'linen')
  own = compare(pair, 'eval', linen_metrics, evaluate(nnx_side, nnx_state),
                'eval metrics after each side\'s own training (the eval steps agree from one state:'
                ' the trained states differ, see the train part)')
  return seen + [line for line in own if line not in seen]


def check_checkpoint(pair: adapter.Pair, direction: str) -> None:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  src_name, dst_name = direction.split('->')
  src, dst = runs.side(src_name), runs.side(dst_name)
  *_, state = runs.trajectory(src_name, 'linen')
  with tempfile.TemporaryDirectory() as d:
    manager = checkpoints.open_manager(d)
    checkpoints.save(manager, 1, src, state, runs.dropout_base())
    restored, key = checkpoints.restore(manager, 1, dst)
    manager.close()
  bitwise.assert_bitwise_equal(
      {**src.to_checkpoint(state), 'dropout_base': runs.dropout_base()},
      {**dst.to_checkpoint(restored), 'dropout_base': key},
      f'{pair.name}: checkpoint {direction} (saved vs restored, checkpoint layout)',
  )


def check_resume(pair: adapter.Pair, direction: str) -> None:
  """Train on one side, save half-way, restore into the other, finish: same as never stopping."""
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  src_name, dst_name = direction.split('->')
  src, dst = runs.side(src_name), runs.side(dst_name)
  half = pair.steps // 2
  state = src.from_checkpoint(runs.start('linen'))
  metrics = []
  for step in range(half):
    state, m = src.train_step(state, runs.batch(step), runs.dropout_base())
    metrics.append(dict(m))
  with tempfile.TemporaryDirectory() as d:
    manager = checkpoints.open_manager(d)
    checkpoints.save(manager, half, src, state, runs.dropout_base())
    state, key = checkpoints.restore(manager, half, dst)
    manager.close()
  for step in range(half, pair.steps):
    state, m = dst.train_step(state, runs.batch(step), key)
    metrics.append(dict(m))
  ref_metrics, ref_final, _ = runs.trajectory(src_name, 'linen')
  compare(pair, 'train', {**per_step(ref_metrics), **ref_final}, {**per_step(metrics), **dst.to_checkpoint(state)},
          f'resume {direction} at step {half} vs an uninterrupted {src_name} run',
          labels=(f'uninterrupted {src_name}', f'resumed in {dst_name}'))


def check_mesh(pair: adapter.Pair, mesh_spec: str) -> list[str]:
  """Both sides on `mesh_spec`: same shardings and annotations, equal train metrics and final state.

  The placement is checked first: a parameter sharded otherwise on one side
  is the cause of the few-ULP differences it makes in the numbers. Numbers
  that differ come with the programs' sharding annotations where those differ
  too (an activation constrained otherwise changes both); annotations that
  differ where the numbers do not fail last (state one side only carries,
  such as an RNG stream kept in an NNX model).
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  (ma, fa, _), (mb, fb, _) = (runs.trajectory(s, 'linen', mesh_spec) for s in ('linen', 'nnx'))
  linen, nnx_side = runs.sides(mesh_spec)
  drift = state_sharding_drift(fa, fb)
  more = [f'  ... and {len(drift) - 50} more'] if len(drift) > 50 else []
  assert not drift, f'{pair.name}: final state shardings differ on {mesh_spec}:\n' + '\n'.join(drift[:50] + more)
  off = [line for side, f in ((linen, fa), (nnx_side, fb)) for line in _off_their_rules(pair, side, f)]
  assert not off, (
      f'{pair.name}: parameters not where their logical axes and the rules put them on'
      f' {mesh_spec}:\n  ' + '\n  '.join(off[:50])
  )
  batch, key = runs.batch(0, mesh_spec=mesh_spec), runs.dropout_base()
  names, annotations, texts = [], [], {}
  placement = []
  for side in (linen, nnx_side):
    state = side.from_checkpoint(runs.start('linen', mesh_spec))
    placement += getattr(side, 'nnx_only_placement', lambda state: [])(state)
    # As the program part compares them: state only one side keeps left out (its placement
    # checked apart, below), the step counter typed alike.
    compared = side.comparison_state(state)
    lowered = getattr(side, 'lower_for_comparison', side.lower_train_step)(compared, batch, key)
    names.append(set(side.argument_names(lowered, compared, batch, key)))
    annotations.append(programs.sharding_annotations(lowered.as_text()))
    texts['linen' if side is linen else 'nnx'] = lowered.as_text(debug_info=True)
  assert not placement, (f'{pair.name}: state only NNX keeps is not where the side places its state'
                         f' on {mesh_spec}:\n  ' + '\n  '.join(placement))
  a, b = annotations
  try:
    found = compare(pair, 'train', {**per_step(ma), **fa}, {**per_step(mb), **fb},
                    f'{pair.steps} train steps on mesh {mesh_spec}')
  except RefusedDeclaration:  # nothing differs beyond the declarations: nothing to localize
    raise
  except AssertionError as e:
    # Localised on the mesh, where the difference shows: the first module whose output or
    # gradient differs there, and each module whose constraints place intermediates otherwise.
    head, _, leaves = str(e).partition('\n')
    raise AssertionError(
        f'{head}\nlocalizer on {mesh_spec}:\n  '
        + '\n  '.join(_mesh_localization(runs, mesh_spec, first_divergent_step(ma, mb), texts))
        + (f'\nthe sharding annotations of the train steps differ too: only linen {dict(a - b)},'
           f' only nnx {dict(b - a)}' if a != b else '')
        + (f'\n{leaves}' if leaves else '')) from None
  assert a == b, (
      f'{pair.name}: sharding annotations of the train steps differ on {mesh_spec}'
      f' (the train metrics and final state there are bit-identical{", or within the declared bounds" if found else ""}):'
      f' only linen {dict(a - b)}, only nnx {dict(b - a)}'
      + ''.join(f'\n  {line}' for line in placement_lib.differing_modules(
          placement_lib.constraints_by_module(texts['linen']), placement_lib.constraints_by_module(texts['nnx'])))
      + programs.one_sided_arguments(names[0] - names[1], names[1] - names[0])
  )
  return found


def _mesh_localization(runs: '_Runs', mesh_spec: str, step: int, texts: dict[str, str]) -> list[str]:
  """The localizer's report on the mesh at `step`, with the modules placing intermediates otherwise."""
  try:
    result = runs.localization(step, 'linen', mesh_spec)
  except Exception as e:  # the localizer must never hide the failure it explains
    return [f'localizer failed: {type(e).__name__}: {e}']
  mesh = runs.side('linen', mesh_spec).mesh
  return [f'(step {step})'] + result.lines() + placement_lib.mesh_lines(mesh, result.first(step) is None, texts)


def state_sharding_drift(linen: Mapping[str, Any], nnx_state: Mapping[str, Any]) -> list[str]:
  """Each path of two states (checkpoint layout, jax arrays) whose shardings differ in
  mesh, device order or partition spec, as parity.core.specs.sharding_drift tells them
  (`P('fsdp')` and `P('fsdp', None)` of a matrix are one spec; an axis of size 1
  named on one side only still counts as a difference)."""
  shardings = [{p: x.sharding for p, x in f.items()} for f in (linen, nnx_state)]
  ndims = {p: np.ndim(x) for f in (linen, nnx_state) for p, x in f.items()}
  return [str(p) for p in specs_lib.sharding_drift(*shardings, ndims)]


def _off_their_rules(pair: adapter.Pair, side: adapter.Side, flat: Mapping[str, Any]) -> list[str]:
  """Each parameter of `flat` (a state in the checkpoint layout) not where the rules put its axes.

  Catches a side that replicates (or shards otherwise) what its annotations
  say to shard, even when the other side does the same.
  """
  rules = [tuple(r) for r in _rules(pair, side, default=())]
  logical = {r[0] for r in rules}  # then each mesh axis as itself: annotations already resolved
  rules += [(axis, axis) for axis in side.mesh.axis_names if axis not in logical]
  lines = []
  for path, names in side.param_specs().items():
    actual = flat[path].sharding
    target = nn.logical_to_mesh_sharding(jax.sharding.PartitionSpec(*names), side.mesh, rules)
    if specs_lib.sharding_drift({path: target}, {path: actual}, {path: np.ndim(flat[path])}):
      lines.append(f'{side.name} {path}: {specs_lib.describe_sharding(actual)}; its logical axes'
                   f' {names} give {specs_lib.describe_sharding(target)}')
  return lines


def check_memory(pair: adapter.Pair) -> list[str]:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  device = jax.devices()[0]
  mem, accounted = _measured_memory(runs, device)
  missing = {s: [f for f in runner.MEMORY_FIELDS if m.get(f) is None] for s, m in zip(('linen', 'nnx'), mem)}
  assert not any(missing.values()), (
      f'{pair.name}: XLA memory analysis not measured on {device.platform} (fields missing: {missing});'
      ' nothing compared. Leave the memory part out on a backend without it (--parity-parts)'
  )
  drift = runner.memory_drift(*mem)
  known = pair.program_difference()
  bound = None if known is None else known.temp_bytes(device.platform)
  if not drift:
    loose = known.loose_structure('memory', None, device.platform) if bound is not None else ''
    assert not loose, f'{pair.name}: {loose}'
    return accounted
  if runner.declared_memory_admits(known, *mem, device.platform):
    measured = runner.temporaries_moved(*mem)
    loose = known.loose_structure('memory', measured, device.platform)
    assert not loose, f'{pair.name}: {loose}'
    return accounted + [f'memory differs within the declared bound (NNX {", ".join(drift)}; at most'
            f' {bound:,} B of temporaries on {device.platform}, {", ".join(known.paths)}: {known.reason})']
  linen, nnx_ = runs.compiled('linen'), runs.compiled('nnx')
  growth = programs.loop_carry_growth(
      linen.compared_text, nnx_.compared_text, linen.argument_names, nnx_.argument_names)
  raise AssertionError(
      f'{pair.name}: XLA memory analysis of the train steps differs: NNX ' + ', '.join(drift)
      + ('' if bound is None else
         f' (beyond the declared memory difference: temporaries and peak within'
         f' {bound:,} B each on {device.platform}, everything else equal)')
      + (f'; in the programs, {growth}' if growth else '')
      + _memory_cause(pair, linen, nnx_, mem, device.platform)
      + _platform_unnamed(known, device.platform, mem)
  )


def _measured_memory(runs: _Runs, device: jax.Device) -> tuple[list[dict[str, Any]], list[str]]:
  """The two train steps' XLA memory analyses as the memory part compares them (NNX's without
  the state only NNX keeps), and the accounting lines for that state."""
  mem = [runs.compiled(s).memory(device) for s in ('linen', 'nnx')]
  if any(m.get(f) is None for m in mem for f in runner.MEMORY_FIELDS):
    return mem, []
  account = getattr(runs.side('nnx'), 'nnx_only_accounting', None)
  if account is None or not account()['paths']:
    return mem, []
  nnx_mem, accounted = runner.without_nnx_only(account(), *mem, runs.compiled('linen'), runs.compiled('nnx'), device)
  return [mem[0], nnx_mem], accounted


def _temporaries_alone_moved(runs: _Runs) -> tuple[str, int] | None:
  """(platform, bytes) where the train steps' memory differs in temporaries and peak alone (the
  state's bytes equal): what a lowering that differs moves, for a declaration; None where the
  memory is equal, the state moved too, or it cannot be measured."""
  device = jax.devices()[0]
  try:
    mem, _ = _measured_memory(runs, device)
    if (any(m.get(f) is None for m in mem for f in runner.MEMORY_FIELDS) or not runner.memory_drift(*mem)
        or runner.memory_drift(*mem, exclude=runner.LAYOUT_MOVE_MEMORY)):
      return None
  except Exception:  # pylint: disable=broad-except  (a hint only)
    return None
  return device.platform, runner.temporaries_moved(*mem)


def _platform_unnamed(known: adapter.KnownDifference | None, platform: str,
                      mem: Sequence[Mapping[str, Any]]) -> str:
  """Where the pair's memory bound is by platform and names not this one: what adding it would take
  (the state's bytes equal, only temporaries moved), or '' (no such bound, or the state moved too)."""
  if (known is None or 'memory' not in known.passes or not isinstance(known.max_temp_bytes, tuple)
      or platform.split('@', 1)[0] not in adapter.PLATFORMS):
    return ''
  if known.temp_bytes(platform) is not None or runner.memory_drift(*mem, exclude=runner.LAYOUT_MOVE_MEMORY):
    return ''
  moved = runner.temporaries_moved(*mem)
  return (f'\nthe declared memory difference ({", ".join(known.paths)}) names no bound on {platform}'
          f' (max_temp_bytes={adapter.temp_bytes_text(known.max_temp_bytes)}); if this is the same cause here, add the'
          f' bytes measured: max_temp_bytes={adapter.temp_bytes_text(known.max_temp_bytes, (platform, moved))}')


def _memory_cause(pair: adapter.Pair, linen: runner.CompiledStep, nnx_: runner.CompiledStep,
                  mem: Sequence[Mapping[str, Any]], platform: str) -> str:
  """The likely cause of a memory difference, from the program comparison (the program part's
  finding): XLA's memory follows the program, so a program that differs is named with where it
  parts; a declared program difference that holds, with the memory declaration it lacks; the
  same program, as such."""
  try:
    d = runner.program_diff_of(linen, nnx_)
  except Exception as e:  # pylint: disable=broad-except  (a hint only: the failure stands without it)
    return f'\nlikely cause: not found (the programs could not be compared: {type(e).__name__}: {e})'
  if d.identical:
    said = ('\nlikely cause: none in the programs, which are identical (the program part passes): XLA lays'
            ' out the same computation otherwise' + (f' ({d.loop_order})' if d.loop_order else ''))
    if runner.memory_drift(*mem, exclude=runner.LAYOUT_MOVE_MEMORY):
      return said  # the state's bytes moved too: not a layout of temporaries alone
    moved = runner.temporaries_moved(*mem)
    return (said + '. Where that layout is flax\'s own and neither model can change it (nn.RNN\'s and'
            " nnx.RNN's loops carry a cell's parameters in another order), declare it with the bytes"
            f" measured: KnownDifference((<the loop's module>,), ('memory',), reason=...,"
            f' max_temp_bytes={{{platform!r}: {moved}}})')
  known = pair.program_difference()
  if known is not None and 'program' in known.passes and 'memory' not in known.passes:
    outside = runner.program_diff_of(linen, nnx_, tuple(known.paths))
    state_equal = not runner.memory_drift(*mem, exclude=runner.LAYOUT_MOVE_MEMORY)
    if known.admits_program(d, outside) and state_equal:
      moved = runner.temporaries_moved(*mem)
      return (f'\nlikely cause: the declared program difference ({", ".join(known.paths)}: {known.reason}), which'
              ' holds (the programs are identical outside those modules): a lowering that differs places its'
              " temporaries otherwise. If so, declare 'memory' beside 'program' in it, with the bytes measured:"
              f" passes={tuple(known.passes) + ('memory',)!r}, max_temp_bytes={moved} (or, where the figure"
              f" is this backend's alone, max_temp_bytes={{{platform!r}: {moved}}})")
  return ('\nlikely cause: the train steps\' programs differ, and XLA\'s memory follows the program. The'
          f' program part\'s finding: {d.summary(loop_growth=False)}'
          + ''.join(f'\n  {line}' for line in d.parting_lines())
          + '\n(the program part names what differs, with the declaration to write where flax\'s stock layers'
          ' explain it' + ('' if runner.memory_drift(*mem, exclude=runner.LAYOUT_MOVE_MEMORY) else
                           "; where it offers one, that declaration takes the memory too, the state's bytes"
                           f" being equal: passes=('program', 'memory'), max_temp_bytes={{{platform!r}:"
                           f' {runner.temporaries_moved(*mem)}}}') + ')')


def check_program(pair: adapter.Pair) -> list[str]:
  """Canonical programs identical, or within the pair's declared program difference."""
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  linen, nnx_ = runs.compiled('linen'), runs.compiled('nnx')
  d = runner.program_diff_of(linen, nnx_)
  known = pair.program_difference()
  if known is not None and 'program' not in known.passes:  # a memory difference alone
    known = None
  if d.identical:
    loose = '' if known is None else known.loose_structure('program', None)
    assert not loose, f'{pair.name}: {loose}'
    return []
  # Confined to the declared modules: with their operations left out, the rest is identical.
  outside = None if known is None else runner.program_diff_of(linen, nnx_, tuple(known.paths))
  if known is not None and outside is not None and outside.identical:
    # Confined to the declared modules: a constant or an operation that differs there is named as
    # what it is before the bound is weighed (a bug moves the line count either way).
    changed = _numbers_part(pair, runs, d).value_changes
    if changed:  # raised, not asserted: pytest would rewrite the lines of an assert's message
      within = ('within the declared bound' if d.changed_lines <= known.max_changed_lines else
                f'beyond the declared bound ({known.max_changed_lines} lines)')
      raise AssertionError(
          f'{pair.name}: the programs differ {within} ({d.changed_lines} canonical lines,'
          f' {", ".join(known.paths)}: {known.reason}), and inside those modules a constant or an operation'
          ' differs, which a program declaration never covers: it declares a lowering with the same numbers'
          ' (a value reshaped otherwise), not other numbers. Where they part:\n  '
          + '\n  '.join(changed[:10]) + (f'\n  ... ({len(changed) - 10} more)' if len(changed) > 10 else '')
          + '\nA bug in those modules; or, where their numbers differ by design, a value bound on them with its'
          ' substitution (docs/plugin.md, "A value bound is proven and tight")')
  if known is not None and known.admits_program(d, outside):
    loose = known.loose_structure('program', d.changed_lines)
    assert not loose, f'{pair.name}: {loose}'
    return [f'{d.changed_lines} canonical lines (declared bound {known.max_changed_lines},'
            f' {", ".join(known.paths)}: {known.reason}); identical outside those modules']
  if known is None or d.changed_lines > known.max_changed_lines:
    where = ''
    if outside is not None:
      where = ('; identical outside those modules: the declared modules changed more than the bound'
               if outside.identical else f'; outside those modules too: {outside.summary(loop_growth=False)}')
    raise AssertionError(
        f'{pair.name}: {d.summary()}'
        + (_suggested_declaration(pair, runs, d) if known is None else
           f' (declared bound {known.max_changed_lines} lines in {", ".join(known.paths)}:'
           f' {known.reason}{where})'
           + ('' if outside.identical else _suggested_declaration(pair, runs, d, known)))
        + ''.join(f'\n{line}' for line in d.parting_lines()) + f'\n{d.diff}'
    )
  raise AssertionError(
      f'{pair.name}: the programs differ outside the modules declared ({", ".join(known.paths)}):'
      f' {outside.summary()} (their operations left out; an NNX side names its module calls'
      f' for this, parity/compare/scopes.py)' + _suggested_declaration(pair, runs, d, known)
      + ''.join(f'\n{line}' for line in outside.parting_lines()) + f'\n{outside.diff}'
  )


def _numbers_part(pair: adapter.Pair, runs: _Runs, d: programs.ProgramDiff,
                  left_out: tuple[str, ...] = ()) -> programs.ProgramDiff:
  """The program diff `d`, with the operations of `left_out` and of the modules whose numbers are
  proven to differ left out (a 'forward' value bound with its substitution, the only kind of
  declaration that lets a constant or an operation differ): its `value_changes` are where the
  numbers part elsewhere."""
  proven = tuple(p for known in pair.known_differences if known.substitute is not None
                 and not substitutes.in_place(known.substitute)  # applied in place: Linen's numbers
                 and 'forward' in known.value_passes for p in known.paths)
  modules = tuple(dict.fromkeys(left_out + proven))
  return d if not modules else runner.program_diff_of(runs.compiled('linen'), runs.compiled('nnx'), modules)


# flax's stock layers whose Linen and NNX versions lower otherwise (the same numbers): the
# program part tries them as a declaration when a pair's programs differ and it declares none.
STOCK_LOWERINGS = ('LayerNorm', 'BatchNorm', 'GroupNorm', 'RMSNorm', 'MultiHeadDotProductAttention',
                   'SelfAttention')


def _is_dropout(module: str) -> bool:
  """Whether a module's path names a dropout (`Dropout_0`, `attention_dropout`)."""
  return 'dropout' in module.rsplit('/', 1)[-1].lower()


def rnn_loop_line(named: str, where: str, path: str, broadcast: Any, scheme: Any) -> str:
  """Why a dropout held in the cell of an `nnx.RNN` (at `path`, its `broadcast_rngs` and
  `parity.pairs.dropout._loop_scheme`) differs, and what to give that RNN."""
  filt = broadcast.__name__ if isinstance(broadcast, type) else repr(broadcast)
  head = (f"{named} draws from an RNG stream the NNX model keeps ({where}), in the cell of the nnx.RNN"
          f" at {path or 'the root'} (broadcast_rngs={filt})")
  docs = ' (docs/plugin.md, "Stock dropout", recurrent dropout)'
  if scheme is None:
    return (head + ", whose filter takes the cell's RNG state in a way the kit does not map onto"
            " Linen's (other RNG state of the cell, or streams that fare otherwise than each other):"
            " the kit leaves the loop as nnx.RNN draws it, its streams drawing their own keys, not"
            " Linen's. Give the NNX RNN broadcast_rngs=None for a mask per step (Linen's nn.RNN(...,"
            " split_rngs={'dropout': True})), or broadcast_rngs='dropout' for one mask for every step"
            " (split_rngs={'dropout': False}), as the Linen side draws" + docs)
  if scheme[0]:
    return (head + ": it broadcasts the stream's count, so its steps draw one mask for every step,"
            " which the kit draws as Linen's split_rngs={'dropout': False} does. Where the Linen"
            " side's RNN draws a mask per step (split_rngs={'dropout': True}), the NNX RNN needs"
            " broadcast_rngs=None" + docs)
  return (head + ": its loop carries the stream's count, so its steps draw a mask each, which the"
          " kit draws as Linen's split_rngs={'dropout': True} does. Where the Linen side's RNN"
          " draws one mask for every step (split_rngs={'dropout': False}), the NNX RNN needs"
          " broadcast_rngs='dropout' (the stream whole)" + docs)


def stock_attention_lines(module: str, modules: Sequence[str] = ()) -> list[str]:
  """Why flax's stock attention differs, and the route that passes with no change to the model:
  the in-place substitution, declared for `modules` (every stock attention of the NNX model,
  by Linen path; `module` alone where they are not known)."""
  modules = tuple(modules) or (module,)
  declaration = (f'parity.KnownDifference({modules!r}, (\'forward\',), "flax\'s stock attention:'
                 f' nnx.MultiHeadAttention\'s default formula rounds otherwise than Linen\'s",'
                 ' substitute=parity.linen_attention)')
  return [f"{module} is flax's stock attention. With dropout_rate 0, nnx.MultiHeadAttention's default calls"
          ' jax.nn.dot_product_attention, which multiplies the logits by 1/sqrt(head_dim) after q.k and lays'
          " its contractions out otherwise; Linen's divides the query by sqrt(head_dim) before q.k. Its"
          ' outputs and gradients can differ at any head_dim, a power of 4 too (docs/plugin.md, "Stock'
          ' attention", has the figures); with a dropout rate above 0 NNX computes Linen\'s formula itself.'
          " To keep the model as it is, declare the difference with the kit's stand-in as its substitute:"
          " the kit then gives every stock nnx.MultiHeadAttention of the NNX model Linen's formula in every"
          ' part, and compares them bit for bit:',
          f'  {declaration}',
          '(the declaration names every one of them; or give the NNX modules attention_fn=parity.linen_attention'
          ' in the model yourself, and declare nothing)']


def _stock_types() -> dict[str, tuple[type, type]]:
  """flax's stock layers of STOCK_LOWERINGS by their Linen class's name: (that Linen class, its
  NNX counterpart). A project's own class of the same name is none of them."""
  types = {'LayerNorm': (nn.LayerNorm, nnx.LayerNorm), 'BatchNorm': (nn.BatchNorm, nnx.BatchNorm),
           'GroupNorm': (nn.GroupNorm, nnx.GroupNorm), 'RMSNorm': (nn.RMSNorm, nnx.RMSNorm),
           'MultiHeadDotProductAttention': (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention),
           'SelfAttention': (getattr(nn, 'SelfAttention', None), nnx.MultiHeadAttention)}
  return {name: classes for name, classes in types.items() if name in STOCK_LOWERINGS and classes[0] is not None}


def _nnx_modules(runs: _Runs, linen_paths: Sequence[str]) -> dict[str, Any]:
  """The NNX side's modules at `linen_paths` (Linen paths, through its renames), in a fresh model;
  a path whose module is not found there is left out (so is every one, for a side of your own)."""
  side = runs.side('nnx')
  if not hasattr(side, 'create') or not hasattr(side, 'renames'):
    return {}
  try:
    with compat.eager_sharding_off():
      model = side.create(runs.pair.seed)[0]
  except Exception:  # pylint: disable=broad-except  (a hint only)
    return {}
  found = {}
  for path in linen_paths:
    node = model
    try:
      for name in filter(None, side.renames.to_nnx(path).split('/')):
        node = node[int(name)] if name.isdigit() else getattr(node, name)
    except Exception:  # pylint: disable=broad-except
      continue
    found[path] = node
  return found


def _suggested_declaration(pair: adapter.Pair, runs: _Runs, d: programs.ProgramDiff,
                           declared: adapter.KnownDifference | None = None) -> str:
  """Where the programs are identical once the fewest kinds of flax's stock layers that lower
  otherwise are left out (beside the modules `declared` already): the declaration to write, its
  bound measured, and the lines that differ there ('' where none does).

  A module counts as flax's stock layer only where it is flax's class itself on both sides (a
  project's own `RMSNorm` is not flax's). Offered only where the lines that differ there reshape
  the same values otherwise (the same numbers); where a constant or an operation differs, it
  says so and offers nothing.
  """
  linen_side = runs.side('linen')
  if not hasattr(linen_side, 'loss'):
    return ''
  try:
    calls = correspond.linen_calls(linen_side, linen_side.init(pair.seed), pair.batch(0, 'train'),
                                   runs.dropout_base())
  except Exception:  # pylint: disable=broad-except  (a hint only: the failure stands without it)
    return ''
  stock = _stock_types()
  base = tuple(declared.paths) if declared is not None else ()
  candidates: dict[str, list[str]] = {}
  for call in calls:
    if (call.cls in stock and call.module_type is stock[call.cls][0] and call.key == call.path
        and call.path not in base and call.path not in candidates.get(call.cls, [])):
      candidates.setdefault(call.cls, []).append(call.path)
  found = _nnx_modules(runs, [p for paths in candidates.values() for p in paths])
  by_class = {cls: [p for p in paths if p in found and type(found[p]) is stock[cls][1]]
              for cls, paths in candidates.items()}
  by_class = {cls: paths for cls, paths in by_class.items() if paths}
  linen, nnx_ = runs.compiled('linen'), runs.compiled('nnx')

  def identical_without(classes) -> bool:
    modules = tuple(p for c in classes for p in by_class[c])
    return bool(modules) and runner.program_diff_of(linen, nnx_, base + modules).identical

  kept = sorted(by_class)
  if not identical_without(kept):
    return ''
  for cls in list(kept):  # the fewest kinds that still explain every difference
    if len(kept) > 1 and identical_without([c for c in kept if c != cls]):
      kept.remove(cls)
  modules = [p for c in kept for p in by_class[c]]
  where = (f'{"the modules declared and " if base else ""}flax\'s stock {", ".join(kept)} ({len(modules)}'
           f' module{"s" if len(modules) != 1 else ""})')
  inside = _numbers_part(pair, runs, d, base)  # what differs, all inside those modules
  if inside.value_changes or not inside.reshapes:
    shown = inside.value_changes[:6] + ([f'... ({len(inside.value_changes) - 6} more)']
                                        if len(inside.value_changes) > 6 else [])
    what = ('a constant or an operation differs, which no lowering of the same numbers explains'
            if inside.value_changes else 'no line that differs reads as a reshape of the same values')
    return (f'\nthe programs are identical outside {where}, but there {what}: no declaration to offer (a bug'
            ' in those modules; or numbers that differ by design, declared as a value bound with its'
            ' substitution)' + ''.join(f'\n  {line}' for line in shown))
  shown = inside.reshapes[:6] + ([f'... ({len(inside.reshapes) - 6} more)'] if len(inside.reshapes) > 6 else [])
  kinds = f'flax\'s stock {", ".join(kept)} {"lowers" if len(kept) == 1 else "lower"} differently in Linen and NNX'
  if declared is None:
    moved = _temporaries_alone_moved(runs)
    passes, temp = (('program',), '') if moved is None else (
        ('program', 'memory'), f', max_temp_bytes={{{moved[0]!r}: {moved[1]}}}')
    declaration = (f'parity.KnownDifference({tuple(modules)!r}, {passes!r}, max_changed_lines={d.changed_lines}'
                   f'{temp}, reason="{kinds} (same numbers)")')
    advice = ('if that is the only difference, declare it (and check the memory part)' if moved is None else
              'if that is the only difference, declare it, with the temporaries the memory part measured'
              f' this lowering to move ({moved[1]:,} B on {moved[0]}, the state\'s bytes equal)')
  else:
    temp = f', max_temp_bytes={adapter.temp_bytes_text(declared.max_temp_bytes)}' if declared.max_temp_bytes else ''
    reason = f'{declared.reason}; {kinds} (same numbers)'
    declaration = (f'parity.KnownDifference({base + tuple(modules)!r}, {tuple(declared.passes)!r},'
                   f' max_changed_lines={d.changed_lines}{temp}, reason={reason!r})')
    advice = ('if that is the only difference, declare them with the modules declared, in place of the'
              ' pair\'s program declaration (the program part reads one; and check the memory part)')
  return (f'\nthe programs are identical outside {where}, whose Linen and NNX versions (flax\'s own classes'
          ' on both sides) lower otherwise;'
          ' the lines that differ there reshape the same values otherwise (the same numbers):'
          + ''.join(f'\n  {line}' for line in shown) + f'\n{advice}:\n  {declaration}')


def check_localize(pair: adapter.Pair) -> list[str]:
  """The localizer finds nothing beyond the pair's declared differences.

  A forward divergence must start in a module declared for the 'forward'
  pass, within its ULP bound; a backward divergence may only touch
  parameters declared for 'grads'. NNX module calls with no Linen call to
  compare with (and no Linen call without an NNX one) are a note where
  every compared output and gradient is bitwise, and named, with what to
  write, where anything differs.
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  result = runs.localization()
  # Not vacuous: every module call and parameter gradient is compared. NNX calls with no
  # Linen call to compare with (a module Linen computes inline) are not a difference: a note
  # where every compared value is bitwise, named where something differs (they may hold it).
  extra = [] if result.only_linen else list(result.only_nnx)
  problems = list(dataclasses.replace(result, only_nnx=[]).unmatched if extra else result.unmatched)
  seen = []
  if result.forward is not None:
    known = pair.known(result.forward, 'forward')
    if known is None:
      problems.append(f'forward divergence in undeclared module {result.forward}')
    elif result.forward_ulp is None:
      problems.append(f'{result.forward}: {result.details[result.forward_call]} (a declared bound in ULP'
                      ' covers float values of one dtype and shape only)')
    elif result.forward_ulp > known.max_ulp:
      problems.append(f'{result.forward}: {result.forward_ulp} ULP exceeds the declared {known.max_ulp}')
    else:
      seen.append(f'{result.forward}: forward, {result.forward_ulp} ULP'
                  f' (declared bound {known.max_ulp}: {known.reason})')
  for known in pair.known_differences:
    if 'forward' in known.value_passes:
      forward = result.forward_ulp if result.forward is not None and known.covers(result.forward, 'forward') else 0
      problems += known.refusals('forward', forward or 0)
  for module, params in result.backward:
    undeclared = [p for p in params if pair.known(p, 'grads') is None]
    if undeclared:
      problems.append(f'backward divergence inside {module}: {undeclared}')
  calls = _nnx_only_calls(runs.side('nnx'), extra)
  if extra and (problems or not result.clean):
    first = calls[0].split(' (Linen ')[0]
    problems.append(
        f'NNX module calls with no Linen counterpart, not compared: {", ".join(calls)}; the difference may'
        ' start in one of them (the localizer names the first compared module it reaches). Where one is'
        ' a Linen module under another name, pair the two with a Renames entry:'
        f" StockNnx(renames=parity.Renames((('<Linen path>', '{first}'),))) (`parity renames --pair"
        ' FILE.py:NAME` prints the correspondences inferred)')
  assert not problems, (
      f'{pair.name}: the localizer finds undeclared differences: {problems}\n  '
      + '\n  '.join(result.lines())
  )
  if extra:
    seen.append(f'NNX module calls with no Linen counterpart, not compared (a note: every compared output'
                f' and gradient is bitwise): {", ".join(calls)}')
  return seen + result.lines()


def _nnx_only_calls(nnx_side: adapter.Side, keys: Sequence[str]) -> list[str]:
  """NNX calls the localizer keys by Linen path, named by their NNX attribute paths (`blocks/0/act
  (Linen DecoderBlock_0/act)`, the Linen name where the side's renames give another)."""
  renames = getattr(nnx_side, 'renames', None)
  shown = []
  for key in keys:
    path, sep, repeat = key.partition('#')
    own = renames.to_nnx(path) if renames is not None and path != localize.ROOT else path
    shown.append(f'{own}{sep}{repeat}' + (f' (Linen {key})' if own != path else ''))
  return shown


def check_substitution(pair: adapter.Pair) -> list[str]:
  """Each declared value bound, proven confined: with its `substitute` sides (the difference
  removed), the pair's value parts (grads, train from Linen, eval, localize) are bit for bit,
  with no value bound declared; so the declared modules are the only source. A stand-in the
  kit applies in place (parity.linen_attention) is in every part already: the line names the
  modules given it."""
  __tracebackhide__ = _battery_frames_hidden
  lines = []
  for known in pair.known_differences:
    if not known.value_passes:
      continue
    if substitutes.in_place(known.substitute):
      lines += _in_place_lines(pair, known)
      continue
    if known.substitute is None:
      unproven = [r for r in known.refusals(known.value_passes[0], 0) if 'no substitution' in r]
      raise AssertionError(f'{pair.name}: ' + unproven[0])
    # In-place stand-ins stay: they are no bound, and every part runs with them.
    rest = tuple(d for d in pair.known_differences if not d.value_passes or substitutes.in_place(d.substitute))
    substituted = dataclasses.replace(pair, name=f'{pair.name} (substituted: {", ".join(known.paths)})',
                                      make_sides=known.substitute, known_differences=rest, parts=None)
    try:
      check_grads(substituted)
      check_train(substituted, 'linen')
      check_eval(substituted)
      check_localize(substituted)
      if substituted.decode is not None:
        from parity.battery.parts import ONE_DEVICE

        check_decode(substituted, ONE_DEVICE)
    except AssertionError as e:
      raise AssertionError(
          f'{pair.name}: with the substitution of {", ".join(known.paths)} ({known.reason}) the pair is'
          f' still not bit-identical, so the declared modules are not the only difference:\n{e}') from None
    lines.append(f'{", ".join(known.paths)}: with the substitution, grads, train, eval, the localizer'
                 f'{" and decoding" if substituted.decode is not None else ""} are bit for bit: the declared'
                 ' modules are the only source')
  return lines


def _in_place_lines(pair: adapter.Pair, known: adapter.KnownDifference) -> list[str]:
  """What an in-place substitution did: the modules the kit gave its stand-in (make_pair_sides
  has checked they are exactly the declared ones), under which every part compares bit for bit."""
  side = _runs(pair).side('nnx')
  given = [p for p, state in side.substituted_modules()[known.substitute.__name__].items() if state == 'substituted']
  cls, attribute, _ = substitutes.IN_PLACE[known.substitute]
  assert given, f'{pair.name}: {known.describe()} was given to no module'  # make_pair_sides refuses it first
  return [f'{", ".join(given)}: {cls.__name__} given {attribute}=parity.{known.substitute.__name__} by the kit in'
          f' every part (no model edited: {known.reason}); their values are compared bit for bit']


def _eval_localized(runs: '_Runs', sides, states, batch) -> list[str]:
  """The eval localizer's finding, as lines for a failure message (parity.compare.eval_localize),
  with what a dropout that returned its input unchanged on one side only, or a batch norm,
  means in eval mode."""
  from parity.compare import eval_localize

  if not all(callable(getattr(s, 'eval_calls', None)) for s in sides):
    return ['eval localizer: not run (a side gives no `eval_calls`)']
  try:  # the eval part's own failure stays the message's first line, whatever the localizer meets
    result = eval_localize.localize_eval(*(side.eval_calls(state, batch) for side, state in zip(sides, states)))
  except Exception as e:  # noqa: BLE001
    return [f'eval localizer: could not run eagerly ({type(e).__name__}: {e})']
  lines = result.lines()
  found = result.first()
  if found is not None and found['unchanged'] is not None and _is_dropout(found['path']):
    on = 'NNX' if found['unchanged'] == 'Linen' else 'Linen'
    lines.append(f"{found['path']}: {on}'s dropout dropped in eval mode, {found['unchanged']}'s did not: {on}'s"
                 " eval step leaves it on. Give it the eval mode there (deterministic=True at the call,"
                 " model.eval() or nnx.view(model, deterministic=True) in an NNX eval step, train=False"
                 " in a Linen apply)")
  elif found is not None and found['unchanged'] is None and isinstance(runs.nnx_module_at(found['path']), nnx.BatchNorm):
    lines.append(f"{found['path']}: a batch norm: in eval mode both sides normalise with its running averages"
                 " (Linen: use_running_average=True, from train=False; NNX: model.eval() sets it, as"
                 " nnx.view(model, use_running_average=True) does: nnx.view(model, deterministic=True) sets"
                 " the dropouts' mode only). A side that normalises with the batch's statistics in its eval"
                 " step differs here")
  return lines


def _decode_localized(pair: adapter.Pair, sides, states, prompt, steps: int, key, temperature) -> list[str]:
  """The decode localizer's finding, as lines for a failure message (parity.compare.decode_localize)."""
  from parity.compare import decode_localize

  if not all(callable(getattr(s, 'decode_calls', None)) for s in sides):
    return ['decode localizer: not run (a side gives no `decode_calls`)']
  try:  # the decode's own failure stays the message's first line, whatever the localizer meets
    calls = [side.decode_calls(state, prompt, steps, key, temperature) for side, state in zip(sides, states)]
    return decode_localize.localize_decode(*calls, steps).lines()
  except Exception as e:  # noqa: BLE001
    return [f'decode localizer: could not run eagerly ({type(e).__name__}: {e})']


def check_decode(pair: adapter.Pair, placement: str) -> list[str]:
  """Decoding with a KV cache from one state (the Linen init, carried to NNX), on one device
  or a mesh: tokens, every step's logits and the final cache, bit for bit, at each temperature."""
  __tracebackhide__ = _battery_frames_hidden
  from parity.battery.parts import ONE_DEVICE

  spec = pair.decode
  if spec is None:
    raise AssertionError(f'{pair.name}: no decoding declared (Pair(decode=parity.Decode(...)))')
  runs = _runs(pair)
  mesh_spec = None if placement == ONE_DEVICE else placement
  linen, nnx_side = runs.sides(mesh_spec)
  missing = [s.name for s in (linen, nnx_side) if not callable(getattr(s, 'decode', None))]
  if missing:
    raise AssertionError(f'{pair.name}: the pair declares decoding, but its {", ".join(missing)} side(s)'
                         ' give no `decode` (StockLinen/StockNnx: decode_fn=)')
  flat = runs.start('linen', mesh_spec)
  states = (linen.from_checkpoint(flat), nnx_side.from_checkpoint(flat))
  prompt = linen.place_batch({'prompt': spec.prompt(pair.batch(0, 'eval'))})['prompt']
  key = rng.decode_key(pair.seed)
  lines = []
  for temperature in spec.temperatures:
    out = [side.decode(state, prompt, spec.steps, key, temperature) for side, state in zip((linen, nnx_side), states)]
    for what in ('tokens', 'logits'):
      a, b = (np.asarray(jax.device_get(o[what])) for o in out)
      if a.shape == b.shape and a.ndim >= 2 and a.dtype == b.dtype:
        same = [bitwise.bitwise_equal(a[:, i], b[:, i]) for i in range(a.shape[1])]
        if not all(same):
          first = same.index(False)
          try:
            compare(pair, 'decode', {what: a}, {what: b},
                    f'decoded {what} ({"greedy" if temperature == 0 else f"temperature {temperature}"},'
                    f' {placement}; first differing decode step: {first} of {spec.steps})')
          except RefusedDeclaration:
            raise
          except AssertionError as e:
            located = _decode_localized(pair, (linen, nnx_side), states, prompt, spec.steps, key, temperature)
            raise AssertionError('\n  '.join([str(e)] + located)) from None
    found = compare(pair, 'decode', {'tokens': out[0]['tokens'], 'logits': out[0]['logits'], **out[0]['cache']},
                    {'tokens': out[1]['tokens'], 'logits': out[1]['logits'], **out[1]['cache']},
                    f'decoded tokens, logits and final cache ({"greedy" if temperature == 0 else f"temperature {temperature}"}, {placement})')
    lines += found
    lines.append(f'{"greedy" if temperature == 0 else f"temperature {temperature}"}, {placement}: {spec.steps}'
                 f' tokens, their logits and {len(out[0]["cache"])} cache arrays bit for bit')
    if mesh_spec is not None:
      lines.append(_cache_placed_alike(pair, out[0]['cache'], out[1]['cache'], placement))
  return lines


def _cache_placed_alike(pair: adapter.Pair, linen: Mapping[str, Any], nnx_cache: Mapping[str, Any],
                        placement: str) -> str:
  """The final caches' arrays placed alike on the mesh (their annotations resolve to the same
  shardings); the caches' paths and values are compared already."""
  __tracebackhide__ = _battery_frames_hidden
  placed = {p: (x.sharding, nnx_cache[p].sharding) for p, x in linen.items()
            if p in nnx_cache and hasattr(x, 'sharding') and hasattr(nnx_cache[p], 'sharding')}
  shown = lambda s: tuple(s.spec) if hasattr(s, 'spec') else s  # noqa: E731
  bad = [f'{p}: Linen {shown(a)}, NNX {shown(b)}' for p, (a, b) in sorted(placed.items())
         if not a.is_equivalent_to(b, np.ndim(linen[p]))]
  assert not bad, (f'{pair.name}: the decoded caches are placed otherwise on {placement}'
                   f' ({len(bad)} of {len(placed)} arrays):\n  ' + '\n  '.join(bad))
  return f'{placement}: the {len(placed)} cache arrays placed alike (their shardings equivalent)'


def check_convert(pair: adapter.Pair, direction: str) -> list[str]:
  """A checkpoint saved by one side's own code (a StandardCheckpointer save of its state after one
  step), converted to the other side's through the pair's correspondences (parity/store/pair_convert.py),
  restored by the other side as its own code restores it, resumes bit for bit: the remaining
  steps' metrics and final state equal an uninterrupted run's."""
  __tracebackhide__ = _battery_frames_hidden
  import orbax.checkpoint as ocp

  from parity.store import pair_convert

  runs = _runs(pair)
  src_name, dst_name = direction.split('->')
  src, dst = runs.side(src_name), runs.side(dst_name)
  state, m = src.train_step(src.from_checkpoint(runs.start('linen')), runs.batch(0), runs.dropout_base())
  metrics = [dict(m)]
  with tempfile.TemporaryDirectory() as d:
    saver = ocp.StandardCheckpointer()
    saver.save(f'{d}/own', pair_convert.own_tree(pair, src_name, src, state))
    saver.wait_until_finished()
    result = pair_convert.convert_checkpoint(pair, f'{d}/own', f'{d}/converted', dst_name, sides=runs.sides())
    layouts = pair_convert.pair_layouts(runs.sides(), pair.saves)
    item = pair_convert.locate(f'{d}/converted', 'DST')
    state = pair_convert.restore_native(item, layouts[result.target_format], dst)
  for step in range(1, pair.steps):
    state, m = dst.train_step(state, runs.batch(step), runs.dropout_base())
    metrics.append(dict(m))
  ref_metrics, ref_final, _ = runs.trajectory(src_name, 'linen')
  found = compare(pair, 'train', {**per_step(ref_metrics), **ref_final}, {**per_step(metrics), **dst.to_checkpoint(state)},
                  f'{src_name}\'s own checkpoint after step 0, converted ({result.source_format} ->'
                  f' {result.target_format}) and resumed in {dst_name}, vs an uninterrupted {src_name} run',
                  labels=(f'uninterrupted {src_name}', f'converted into {dst_name}'))
  notes = [f'{result.source_format} -> {result.target_format}: {result.arrays} arrays']
  if result.dropped or result.initialised:
    notes.append(f'state only NNX keeps: {len(result.dropped)} leaves left out, {len(result.initialised)}'
                 ' as create(0) makes them')
  return notes + found
