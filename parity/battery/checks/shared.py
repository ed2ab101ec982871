"""What the battery's parts share: the runs of one pair computed once per process (`_runs`), the
bitwise comparison under declared differences (`compare`) and the localizer's report on a failure."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping, Sequence

import jax
from flax import nnx
import numpy as np

from parity.battery.checks.messages import _is_dropout, rnn_loop_line, stock_attention_lines
from parity.compare import localize
from parity.core import bitwise
from parity.core import compat
from parity.core import paths
from parity.core import rng
from parity.core.errors import TreeMismatchError
from parity.pairs import adapter
from parity.pairs import dropout as pair_dropout
from parity.pairs import substitutes
from parity.procs import distributed
from parity.run import compiling


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
    rates = self.dropout_rates(module)
    if rates is not None:  # a rate is the model's: named before any key
      return [f"{named}: the dropout rates differ: Linen's {rates[0]}, NNX's {rates[1]}. A rate is the"
              " model's own, not the keys': give both dropouts the same rate"]
    if getattr(side, 'dropout_keys', None) != 'linen':
      return [f"{named} draws its dropout mask from an RNG stream the NNX model keeps ({where}), Linen's"
              " from make_rng('dropout'): their masks cannot be equal. Give the NNX side Linen's keys,"
              " with no change to either model: StockNnx(..., dropout_keys='linen') seeds the streams"
              " the model keeps with the key Linen's apply receives (docs/reference-dropout.md, \"Stock dropout\")"]
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

  def dropout_rates(self, module: str) -> tuple[float, float] | None:
    """(Linen's rate, NNX's) of the dropout at Linen path `module` where both are known and differ
    (Linen's read in the kit's trace of its loss: `linen_draws`), else None."""
    rates = dict(getattr(self.side('nnx'), 'linen_rates', ()) or ())
    linen = pair_dropout.linen_rate(module.split('#', 1)[0], rates)
    nnx_rate = getattr(self.nnx_module_at(module.split('#', 1)[0]), 'rate', None)
    if linen is None or nnx_rate is None or linen != linen or float(linen) == float(nnx_rate):
      return None
    return linen, nnx_rate

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
              ' (docs/reference-dropout.md, "Stock dropout")']
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
              " StockNnx(..., dropout_keys='linen') (docs/reference-dropout.md, \"Stock dropout\")"]
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
  def compiled(self, side_name: str) -> compiling.CompiledStep:
    side = self.side(side_name)
    recorded = getattr(side, 'recorded_step', None)  # a recorded side (parity/records/): its step as recorded
    if recorded is not None:
      return recorded()
    start = self.start('linen')
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in start.values()):  # a record of shapes alone
      state = adapter.abstract_state(side)
    else:
      state = side.from_checkpoint(start)
    return compiling.compile_step(side, state, self.batch(0), self.dropout_base())


def _stock_value_and_grads(side: adapter.Side) -> bool:
  """Whether `side.value_and_grads` is the stock sides' (parity/pairs/stock/), directly or
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
               ' the kit then gives the NNX model Linen\'s formula in every part (docs/howto-differences.md,'
               ' "Stock attention")')
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


def _rules(pair: adapter.Pair, side: adapter.Side, default):
  """The pair's logical axis rules, else the side's, else `default`."""
  if pair.rules is not None:
    return pair.rules
  return getattr(side, 'rules', None) or default


def _unproven_line(params: Sequence[str], what: str) -> list[str]:
  """A note naming the parameters the numbers did not prove (none: no line)."""
  if not params:
    return []
  shown = ', '.join(params[:20]) + (f', ... and {len(params) - 20} more' if len(params) > 20 else '')
  return [f'not proven by values: {len(params)} parameter(s) {what}: a bug in what computes them, or in'
          f' what they feed, changes no number compared here ({shown})']
