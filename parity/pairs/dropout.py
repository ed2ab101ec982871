"""Stock dropout, bit for bit: NNX dropout calls draw the keys Linen's `make_rng('dropout')` gives.

Linen's `nn.Dropout` without a key at the call draws `make_rng('dropout')`:
the key passed to `apply(..., rngs={'dropout': key})` with the module's scope
path and its per-scope call count folded in (flax `core/scope.py`, `LazyRng`).
`nnx.Dropout` called with an `nnx.Rngs` (or a stream) draws that stream's
next key, a count folded into the stream's key. The two can never give the
same masks, though both are a pure function of the step's key.

`StockNnx(dropout_keys='linen')` makes them equal with no change to either
model: while the kit traces the NNX side, each `nnx.Dropout` call draws
instead the key Linen's `make_rng('dropout')` gives its corresponding Linen
call (its path through the pair's correspondences, its count), wherever its
own key comes from:

- an `nnx.Rngs` or stream given *at the call*: from the stream's key as
  Linen's root key (the key the NNX step derives is the one Linen's apply
  receives);
- a stream the model holds (`nnx.Dropout(rate, rngs=rngs)` in `__init__`):
  the kit seeds it, before each traced step or loss, with the root key
  Linen's apply receives there (`seed_held_streams`: the loss's key, or in a
  train step `parity.step_key(dropout_base, step, 0)`, as the stock Linen
  steps derive it). A stream stacked by `nnx.vmap` over L layers (run by
  `jax.lax.scan`, `nnx.scan` or vmapped) gets `jax.random.split(root, L)`,
  one key per layer, which is what Linen's `nn.scan` / `nn.vmap` with
  `split_rngs={'dropout': True}` gives each layer before folding in the
  module's path;
- a stream the cell of an `nnx.RNN` keeps (recurrent dropout): where the
  loop carries its count (a mask per step), the RNN scans it instead while
  the kit traces, `jax.random.split(key, T)`, one key per step, as Linen's
  `nn.RNN(..., split_rngs={'dropout': True})` splits it; where the RNN
  broadcasts its count (`broadcast_rngs`, one mask for every step), each
  step reads the stream's key itself, broadcast, as Linen's
  `split_rngs={'dropout': False}` hands each step the key unsplit
  (`_loop_scheme`). An RNN called twice in one step splits the same key at
  each call and draws on with the count, as Linen's does: each call of
  nnx.RNN runs on a copy of the stream, so the kit counts the draws by the
  stream the cell holds outside the loop (`_LOOP_STREAMS`).

So does the attention dropout of an `nnx.MultiHeadAttention` (Linen's
`MultiHeadDotProductAttention` draws `make_rng('dropout')` in its own
scope). The stream still advances as it would. What stays unproven is the
key derivation itself, which is each framework's own; everything the masks
feed is compared bit for bit.

Not covered, and left as drawn: a key array passed at the call (already the
same on both sides when the Linen side passes it too), streams stacked more
than once (a scan of scans), an `nnx.RNN` whose `broadcast_rngs` the kit
cannot read as a mask per step or one for every step (`_loop_scheme`: left as drawn, its
streams drawing their own keys, so that it fails), and Linen modules whose RNGs a lifted
transform folds otherwise than `nn.scan` / `nn.vmap` split them. Untested: a Linen module that
draws both outside and inside a lifted transform in one pass (`linen_draws` keeps its counts in
order).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Iterator, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from parity.core import compat
from parity.compare import scopes

SCHEMES = ('nnx', 'linen')


def linen_draws(traced_loss: Callable[..., Any], *args: Any,
                wrapped: dict[str, list[tuple[int, tuple[int, ...]]]] | None = None,
                rates: dict[str, float] | None = None) -> dict[str, tuple[int, ...]]:
  """The counts Linen's `make_rng('dropout')` draws with, by scope path, in `traced_loss(*args)` (one
  abstract trace of the Linen side's train-mode loss).

  A count is the scope's draw number, folded into the key. `nn.scan` traces
  its body twice with shared counters: first to check its broadcast values
  (`compat.flax_scan_checks`), then in the loop's trace, where its modules go
  on counting. The check's draws are left out, and each path
  keeps the counts of the draws whose keys are used, in order, however many
  traces they are in: one `nn.Dropout` applied twice in one pass (in scope
  objects of its own, in one trace), one `nn.RNN` called twice (each call a
  loop, a trace, of its own: counts 2 and 4, as each call's check drew 1 and 3).
  """
  from flax.core import scope as core_scope

  original = core_scope.Scope.make_rng
  drawn: dict[str, list[int]] = collections.defaultdict(list)
  lineage = _Lineage()

  def make_rng(self, name: str = 'params'):
    key = original(self, name)
    if name == 'dropout' and self.has_rng('dropout') and not checking:
      path = '/'.join(self.path)
      drawn[path].append(self.rng_counters[name])
      lineage.made(key, path, self.rng_counters[name])
    return key

  linen_rates: dict[str, float] = {}

  def rate_of(next_fun, args, kwargs, context):
    """Each drawing `nn.Dropout`'s rate, by its scope path (what a failure compares with NNX's)."""
    module = context.module
    if isinstance(module, nn.Dropout) and context.method_name == '__call__' and module.scope is not None:
      linen_rates['/'.join(module.scope.path)] = module.rate
    return next_fun(*args, **kwargs)

  with compat.flax_scan_checks() as checking, lineage.tracing(), nn.intercept_methods(rate_of):
    core_scope.Scope.make_rng = make_rng
    try:
      jax.eval_shape(traced_loss, *args)
    finally:
      core_scope.Scope.make_rng = original
  if wrapped is not None:
    wrapped.update(lineage.dropouts)
  if rates is not None:
    rates.update(linen_rates)
    rates.update({f'{path}/*': rate for path, rate in lineage.rates.items()})
  return {path: tuple(counts) for path, counts in drawn.items()}


def linen_rate(linen_path: str, rates: Mapping[str, float]) -> float | None:
  """The rate of the Linen side's dropout at `linen_path` (an `nn.Dropout`, or an NNX dropout behind
  a wrapper there: the wrapper's, where its dropouts share one), from `linen_draws`' `rates`; None
  where the Linen side has none there or cannot tell."""
  if linen_path in rates:
    return rates[linen_path]
  wrapper = _wrapper_of(linen_path, {p[:-2]: r for p, r in rates.items() if p.endswith('/*')})
  return None if wrapper is None else rates[wrapper + '/*']


class _Lineage:
  """Where the keys of NNX dropouts inside a Linen apply come from (an NNX module behind a ToLinen
  wrapper, the project's own copy or flax's): a key Linen's make_rng('dropout') gave at a scope
  path, made an `nnx.Rngs` stream by the wrapper, then folded by the streams' draws (a fork at
  construction draws once, a dropout's call once more). Followed by behaviour, through the keys
  themselves: every key made by make_rng, every stream made of a followed key, every key a followed
  stream draws. `dropouts`: by the make_rng scope path, each NNX dropout's draw in order, as (the
  make_rng count, the counts folded in after it)."""

  def __init__(self):
    self.keys: dict[int, tuple[str, int, tuple[int, ...]]] = {}
    self.streams: dict[int, list] = {}  # id(stream) -> [(path, count, folds), draws so far]
    self.dropouts: dict[str, list[tuple[int, tuple[int, ...]]]] = collections.defaultdict(list)
    self.rates: dict[str, float] = {}  # by the make_rng scope path: the wrapped dropouts' rate, where one
    self._alive: list = []  # every followed object, kept so that its id stays its own

  def made(self, key, path: str, count: int) -> None:
    self.keys[id(key)] = (path, count, ())
    self._alive.append(key)

  @contextlib.contextmanager
  def tracing(self) -> Iterator[None]:
    stream_init, stream_call, dropout_call = nnx.RngStream.__init__, nnx.RngStream.__call__, nnx.Dropout.__call__
    lineage = self

    def init(self, key, *args, **kwargs):
      origin = lineage.keys.get(id(key))
      stream_init(self, key, *args, **kwargs)
      if origin is not None:
        lineage.streams[id(self)] = [origin, 0]
        lineage._alive.append(self)

    def draw(self):
      key = stream_call(self)
      followed = lineage.streams.get(id(self))
      if followed is not None:
        (path, count, folds), n = followed
        followed[1] += 1
        lineage.keys[id(key)] = (path, count, folds + (n,))
        lineage._alive.append(key)
      return key

    def dropout(self, inputs, *, deterministic=None, rngs=None):
      off = deterministic if deterministic is not None else self.deterministic
      source = rngs if rngs is not None else getattr(self, 'rngs', None)
      if isinstance(source, nnx.Rngs):
        source = getattr(source, self.rng_collection, None)
      followed = lineage.streams.get(id(source)) if isinstance(source, nnx.RngStream) else None
      if followed is not None and not off and self.rate not in (0.0, 1.0):
        (path, count, folds), n = followed
        lineage.dropouts[path].append((count, folds + (n,)))
        if lineage.rates.get(path, self.rate) == self.rate:
          lineage.rates[path] = self.rate
        else:  # two rates behind one wrapper: which is whose, the kit cannot tell
          lineage.rates[path] = float('nan')
      return dropout_call(self, inputs, deterministic=deterministic, rngs=rngs)

    nnx.RngStream.__init__, nnx.RngStream.__call__, nnx.Dropout.__call__ = init, draw, dropout
    try:
      yield
    finally:
      nnx.RngStream.__init__, nnx.RngStream.__call__, nnx.Dropout.__call__ = stream_init, stream_call, dropout_call


@contextlib.contextmanager
def linen_dropout_keys(call_keys: Mapping[str, str] = {},
                       draws: Mapping[str, tuple[int, ...]] = {},
                       wrapped: Mapping[str, tuple[tuple[int, tuple[int, ...]], ...]] = {},
                       ) -> Iterator[collections.Counter]:
  """While active, every `nnx.Dropout` call given an Rngs or stream at the call draws Linen's key.

  The module's Linen path is its tag (`scopes.tag_paths` with the pair's
  renames, set by the kit before tracing); `call_keys` maps an NNX call
  (`path#n`) to the Linen call it is; `draws` gives the counts Linen draws
  with at a path (`linen_draws`; a path not in it: 1, 2, ... as a plain
  module draws); `wrapped`, the draws of NNX dropouts behind a Linen ToLinen wrapper, by the
  wrapper's scope path (`linen_draws`, `_Lineage`): an NNX call whose Linen path lies under one
  draws, in order, the wrapper's make_rng key folded as the Linen side's streams folded it.
  Yields a counter of the calls substituted, by Linen call.
  """
  original = nnx.Dropout.__call__
  original_attention = nnx.MultiHeadAttention.__call__
  # Counted per Rngs object passed, as Linen counts per `apply`: one forward pass each.
  nnx_calls: collections.Counter = collections.Counter()
  linen_counts: collections.Counter = collections.Counter()
  substituted: collections.Counter = collections.Counter()
  seen: list = []  # the Rngs objects counted, kept alive so that their ids stay theirs

  def call_of(module, rngs, held: bool = False) -> tuple[int, str] | None:
    """(the forward pass, the NNX call `path#n`) of a tagged module given an Rngs or stream at
    the call, counted; None for any other call (left as it is)."""
    path = scopes.tagged_path(module)
    if path is None or not isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
      return None
    # Inside an nnx.RNN's loop a held stream is the loop's copy, another object at every call of
    # the RNN: its forward pass is the stream the RNN's cell holds outside the loop.
    forward = _LOOP_STREAMS[-1] if _LOOP_STREAMS and held else rngs
    seen.append(forward)
    n = nnx_calls[id(forward), path]
    nnx_calls[id(forward), path] += 1
    return id(forward), path if n == 0 else f'{path}#{n}'

  held_roots: list = []  # (trace, the first held stream's key read in it)

  def held_root(stream):
    """A held stream's key, which `seed_held_streams` made the same for every held stream a trace
    sees (the root, or one layer's key of the split): the first one read in the trace, so that
    a layer's streams enter a loop as one array of keys, as Linen's one split does."""
    trace = compat.current_trace()
    for seen_trace, key in held_roots:
      if seen_trace == trace:
        return key
    held_roots.append((trace, stream.key[...]))
    return held_roots[-1][1]

  def linen_key(forward: int, call: str, stream, held: bool = False):
    """The key Linen's make_rng('dropout') gives the Linen call of NNX `call`, from the stream's
    key as Linen's root; the stream advances as the draw it replaces would advance it."""
    root = held_root(stream) if held else stream.key[...]
    stream()
    linen_call = call_keys.get(call, call)
    linen_path = linen_call.split('#', 1)[0]
    linen_counts[forward, linen_path] += 1
    substituted[linen_call] += 1
    n = linen_counts[forward, linen_path]
    wrapper = _wrapper_of(linen_path, wrapped)
    if wrapper is not None:  # behind a ToLinen on the Linen side: the wrapper's key, folded as its streams did
      linen_counts[forward, '#wrapped', wrapper] += 1
      drawn = wrapped[wrapper]
      m = linen_counts[forward, '#wrapped', wrapper]
      if m <= len(drawn):  # a draw more than the Linen side's: none of its keys (below), so that it differs
        count, folds = drawn[m - 1]
        key = compat.linen_make_rng(root, wrapper.split('/') if wrapper else [], count)
        for fold in folds:
          key = jax.random.fold_in(key, fold)
        return key
    counts = draws.get(linen_path, ())
    count = counts[n - 1] if n <= len(counts) else n
    return compat.linen_make_rng(root, linen_path.split('/') if linen_path else [], count)

  def __call__(self, inputs, *, deterministic=None, rngs=None):
    # No key at the call: the stream the module holds (seeded by `seed_held_streams`).
    source = rngs if rngs is not None else _held(self)
    off = deterministic if deterministic is not None else self.deterministic
    if off or self.rate == 0.0 or self.rate == 1.0 or (rngs is None and _NATIVE_LOOPS):
      return original(self, inputs, deterministic=deterministic, rngs=rngs)
    if isinstance(rngs, jax.Array):  # a key the model made itself: left as drawn, and told
      _note_key_at_the_call(self, rngs)
    found = call_of(self, source, held=rngs is None)
    if found is None:
      return original(self, inputs, deterministic=deterministic, rngs=rngs)
    stream = source[self.rng_collection] if isinstance(source, nnx.Rngs) else source
    key = linen_key(*found, stream, held=rngs is None)
    return original(self, inputs, deterministic=deterministic, rngs=key)

  def attention(self, *args, rngs=None, **kwargs):
    """`nnx.MultiHeadAttention` given an Rngs or stream at the call, or holding one: its attention
    dropout draws (`rngs()`, where it draws at all) the key Linen's draws with make_rng('dropout')
    in its scope."""
    source = rngs if rngs is not None else _held(self)
    found = (call_of(self, source, held=rngs is None)
             if self.dropout_rate and not (rngs is None and _NATIVE_LOOPS) else None)
    if found is None:
      return original_attention(self, *args, rngs=rngs, **kwargs)
    stream = source['dropout'] if isinstance(source, nnx.Rngs) else source
    held = rngs is None
    return original_attention(self, *args, rngs=lambda: linen_key(*found, stream, held), **kwargs)

  nnx.Dropout.__call__ = __call__
  nnx.MultiHeadAttention.__call__ = attention
  nnx.RNN.__call__ = _rnn_with_steps_keys(original_rnn := nnx.RNN.__call__)
  try:
    yield substituted
  finally:
    nnx.Dropout.__call__ = original
    nnx.MultiHeadAttention.__call__ = original_attention
    nnx.RNN.__call__ = original_rnn


def _wrapper_of(linen_path: str, wrapped: Mapping[str, Any]) -> str | None:
  """The deepest wrapper scope path of `wrapped` that `linen_path` lies under, or None."""
  under = [p for p in wrapped if linen_path.startswith(p + '/')]
  return max(under, key=len) if under else None


# The dropouts that drew with a key array given at the call (left as drawn), by (class, Linen path):
# what the failure names (`key_at_the_call`).
_KEYS_AT_THE_CALL: dict[tuple[str, str], str] = {}


def _note_key_at_the_call(module: nnx.Module, key: jax.Array) -> None:
  path = scopes.tagged_path(module)
  if path is not None:
    kind = 'a typed key' if _typed(key) else 'raw key data'
    _KEYS_AT_THE_CALL[type(module).__qualname__, path] = f'{kind}, {key.dtype}{list(key.shape)}'


def key_at_the_call(linen_path: str) -> str | None:
  """'ClassName got <what>' where a dropout at `linen_path` (its Linen path) drew, while the kit
  gave the NNX side Linen's keys, with a key array passed at the call, which the kit leaves as
  drawn; None where none did."""
  for (name, path), what in _KEYS_AT_THE_CALL.items():
    if path == linen_path:
      return f'{name} got {what}'
  return None


# Set while an nnx.RNN the kit leaves as drawn runs (`_rnn_with_steps_keys`): the streams held in
# its cell draw their own keys there, not Linen's, so that a loop the kit cannot map onto Linen's
# fails rather than passing with keys of the kit's making.
_NATIVE_LOOPS: list[bool] = []
# While an nnx.RNN the kit draws runs its loop: the first stream its cell holds (outside the loop),
# which counts the held draws of every call of that RNN in one forward pass (`call_of`).
_LOOP_STREAMS: list[Any] = []


def _rnn_with_steps_keys(original: Callable[..., Any]) -> Callable[..., Any]:
  """`nnx.RNN.__call__` where its cell keeps dropout streams, each drawn as Linen's `nn.RNN` draws
  the same masks (`_loop_scheme`). A stream whose count the loop carries (a mask per step: no
  `broadcast_rngs`, or one that leaves the count out) enters the loop as one key per step,
  `jax.random.split(key, T)` scanned, as Linen's `split_rngs={'dropout': True}` splits the key over
  the T steps. A stream whose count the RNN broadcasts (one mask for every step) enters every step
  as its own key, as Linen's `split_rngs={'dropout': False}` hands each step the key unsplit.
  After the loop each stream holds its key again, its count advanced as nnx.RNN's own loop
  advances it. Any other RNN is left as nnx.RNN draws it, its streams drawing their own keys."""

  def __call__(self, inputs, **kwargs):
    held = held_streams(self.cell)
    if not held:
      return original(self, inputs, **kwargs)
    scheme = _loop_scheme(self, held)
    if scheme is None:
      _NATIVE_LOOPS.append(True)
      try:
        return original(self, inputs, **kwargs)
      finally:
        _NATIVE_LOOPS.pop()
    per_sequence, split_draws = scheme
    streams = [stream for _, stream in held]
    time_major = kwargs.get('time_major')
    time_major = self.time_major if time_major is None else time_major
    steps = inputs.shape[0 if time_major else inputs.ndim - (self.cell.num_feature_axes + 1)]
    before = [(stream, stream.key[...], stream.count[...]) for stream in streams]
    for stream, key, count in before:
      if key.ndim != (0 if _typed(key) else 1):
        raise NotImplementedError(
            f'a dropout stream of more than one key (shape {key.shape}) in the cell of an nnx.RNN: the kit'
            ' gives a recurrent cell one key per step, from a stream of one key')
    # By path in the cell (the loop's copies of the cell hold other objects): the streams' own key
    # and count, kept as the module's `rngs` (`_held`), not the module's other variables. For one
    # mask for every step each step reads the stream's key itself, broadcast into the loop as
    # Linen's unsplit key is; the count is scanned either way.
    prefixes = [tuple(path.split('/')) + _kept_path(_module_at(self.cell, path)) for path, _ in held]
    under = lambda path, p: tuple(map(str, path[:len(p)])) == p  # noqa: E731
    keys_of = lambda path, value: any(under(path, p + ('key',)) for p in prefixes)  # noqa: E731
    per_step = lambda path, value: any(under(path, p) for p in prefixes)  # noqa: E731
    axes, broadcast_rngs = self.state_axes, self.broadcast_rngs
    self.state_axes = nnx.StateAxes(((keys_of, None),) * per_sequence + ((per_step, 0),) + tuple(axes.items()))
    self.broadcast_rngs = None  # the keys below are Linen's, nnx.RNN's split left out
    _LOOP_STREAMS.append(streams[0])
    try:
      for stream, key, count in before:
        if not per_sequence:
          compat.set_variable_value(stream.key, jax.random.split(key, steps))
        compat.set_variable_value(stream.count, jnp.broadcast_to(count, (steps,)))
      return original(self, inputs, **kwargs)
    finally:
      _LOOP_STREAMS.pop()
      self.state_axes, self.broadcast_rngs = axes, broadcast_rngs
      for stream, key, count in before:
        if per_sequence:  # a broadcast count does not advance; nnx.RNN's split of the key draws once
          drawn = jnp.asarray(split_draws, count.dtype)
        else:  # every step's draws
          drawn = jnp.sum(stream.count[...] - count, dtype=count.dtype)
        compat.set_variable_value(stream.key, key)
        compat.set_variable_value(stream.count, count + drawn)

  return __call__


def _loop_scheme(rnn: nnx.RNN, held: list[tuple[str, nnx.RngStream]]) -> tuple[bool, int] | None:
  """How nnx.RNN's own loop draws its cell's held streams, as (one mask for every step, the draws
  its split of the keys makes: 0 or 1), or None where the kit cannot map it onto Linen's.

  nnx.RNN broadcasts the RNG state its `broadcast_rngs` takes (`nnx.All(nnx.RngState, filter)`)
  and carries the rest; it splits a stream once first where the filter takes its key and its
  count. A step draws `fold_in(key, count)`: the masks differ from step to step where the count
  is carried, and are one mask for every step where it is broadcast. None (left as drawn) where
  the filter takes other RNG state of the cell (which the kit's loop would carry), the held
  streams fare otherwise than each other, or a stream is matched otherwise by where flax's split
  looks at it (`(0, 0, *path)`, the arguments of its scanned function) than by where its loop
  does (`path`, in the cell)."""
  if rnn.broadcast_rngs is None:
    return False, 0
  predicate = nnx.filterlib.to_predicate(nnx.All(nnx.RngState, rnn.broadcast_rngs))
  held_ids = {id(stream) for _, stream in held}
  schemes = set()
  for path, stream in nnx.iter_graph(rnn.cell):
    if not isinstance(stream, nnx.RngStream):
      continue
    taken = {}
    for name, variable in (('key', stream.key), ('count', stream.count)):
      views = {predicate((*prefix, *path, name), variable) for prefix in ((), (0, 0))}
      if len(views) != 1:
        return None
      taken[name] = views.pop()
    if id(stream) not in held_ids:
      if any(taken.values()):
        return None
      continue
    schemes.add((taken['count'], int(taken['key'] and taken['count'])))
  return schemes.pop() if len(schemes) == 1 else None


def rnn_loops(model: nnx.Module, nnx_module: str) -> list[tuple[str, Any, tuple[bool, int] | None]]:
  """(NNX path, `broadcast_rngs`, `_loop_scheme`) of each `nnx.RNN` on the way to `nnx_module`
  (an NNX path; a loop index in it is skipped) whose cell keeps dropout streams; [] where there
  is none."""
  found, node, path = [], model, []
  for name in filter(None, nnx_module.split('/')):
    if isinstance(node, nnx.RNN):
      held = held_streams(node.cell)
      if held:
        found.append(('/'.join(path), node.broadcast_rngs, _loop_scheme(node, held)))
    if name.isdigit() and not hasattr(node, '__getitem__'):
      continue  # a loop's index (`rnn/cell/1/dropout`): the module is the loop's own
    node = node[int(name)] if name.isdigit() else getattr(node, name)
    path.append(name)
  return found


# The stream whose key Linen's apply receives for its dropouts (`rngs={'dropout': key}`): a kept
# stream of another collection (`nnx.Dropout(..., rng_collection='params')`) is not given Linen's keys.
LINEN_STREAM = 'dropout'


def _kept(module) -> Any:
  """The RNG stream a dropout (or attention) draws from when given no key at the call, whatever its
  tag, or None: the stream it keeps as `rngs` (stock `nnx.Dropout`: a fork of one stream), or, where
  it keeps a whole `nnx.Rngs` (forked or not, any streams: a codebase's own dropout subclass), the
  stream of that Rngs it draws, `rngs[rng_collection]`, as `nnx.Dropout.__call__` reads it."""
  held = getattr(module, 'rngs', None)
  if isinstance(held, nnx.Rngs):
    try:
      held = held[getattr(module, 'rng_collection', LINEN_STREAM)]
    except (KeyError, AttributeError):
      return None
  return held if isinstance(held, nnx.RngStream) else None


def _kept_path(module) -> tuple[str, ...]:
  """Where in `module` the stream `_kept` finds lives: ('rngs',), or ('rngs', its name in the Rngs)."""
  held = getattr(module, 'rngs', None)
  if isinstance(held, nnx.Rngs):
    stream = _kept(module)
    return ('rngs', *[name for name, s in vars(held).items() if s is stream][:1])
  return ('rngs',)


def _module_at(root: nnx.Module, path: str) -> Any:
  """The node at NNX path `path` ('a/b/0/c') under `root`."""
  node = root
  for name in filter(None, path.split('/')):
    node = node[int(name)] if name.isdigit() and hasattr(node, '__getitem__') else getattr(node, name)
  return node


def _held(module) -> Any:
  """The kept stream the kit gives Linen's keys to, or None: a dropout of the 'dropout' collection
  (`nnx.Dropout`'s default `rng_collection`; an attention's dropout always is) keeping a stream
  forked from the model's 'dropout' stream, or from its 'default' stream where the model's Rngs
  has no 'dropout' one (`nnx.Rngs(seed)`: nnx.Rngs falls back to 'default')."""
  stream = _kept(module)
  if stream is None or getattr(module, 'rng_collection', LINEN_STREAM) != LINEN_STREAM:
    return None
  return stream if getattr(stream, 'tag', LINEN_STREAM) in (LINEN_STREAM, 'default') else None


def _drawing(model: nnx.Module) -> Iterator[tuple[str, Any]]:
  """(NNX path, module) of each stock `nnx.Dropout` or `nnx.MultiHeadAttention` of `model` that
  draws (a rate above 0), in graph order."""
  for path, node in nnx.iter_graph(model):
    if ((isinstance(node, nnx.Dropout) and node.rate not in (0.0, 1.0))
        or (isinstance(node, nnx.MultiHeadAttention) and node.dropout_rate)):
      yield '/'.join(str(p) for p in path), node


def held_streams(model: nnx.Module) -> list[tuple[str, nnx.RngStream]]:
  """(NNX path, stream) of each 'dropout' stream a stock `nnx.Dropout` or `nnx.MultiHeadAttention`
  of `model` keeps and draws from (a rate above 0), in graph order."""
  return [(path, _held(node)) for path, node in _drawing(model) if _held(node) is not None]


def other_streams(model: nnx.Module) -> list[tuple[str, str]]:
  """(NNX path, tag) of each stream a drawing stock dropout of `model` keeps that is forked from
  another stream than 'dropout': left as drawn (its masks are not Linen's, whatever the keys)."""
  return [(path, _kept(node).tag) for path, node in _drawing(model)
          if _kept(node) is not None and _held(node) is None]


# A held stream seeded and not yet resolved (static data of the graphdef, so the copies a jit
# or a transform makes carry it): (the layers it is stacked over, 0 for none; whether its key
# is a step's base key, its count the step, rather than the root itself).
_PENDING = '_parity_pending_seed'


def seed_held_streams(model: nnx.Module, root: Any, step: Any = None) -> int:
  """Seeds every stream `held_streams` finds with the key Linen's apply receives, resolved inside
  the model's call (`resolving_seeds`), where the Linen step derives its key: `root` itself, or
  with `step`, `parity.step_key(root, step, 0)`; a stream stacked over L layers then gets
  `jax.random.split(key, L)` (Linen's `nn.scan` / `nn.vmap` with `split_rngs`).

  Here the stream only takes `root` as its key (and `step` as its count): no operation. Returns
  how many streams were seeded.
  """
  streams = held_streams(model)
  for _, stream in streams:
    current = stream.key[...]
    typed = _typed(current)
    stacked = current.ndim - (0 if typed else 1)
    if stacked > 1:
      raise NotImplementedError(
          f'a dropout stream stacked over {stacked} axes (shape {current.shape}): the kit seeds '
          'streams of one key or stacked once (one scan or vmap over layers)')
    object.__setattr__(stream, _PENDING, (current.shape[0] if stacked else 0, step is not None))
    compat.set_variable_value(stream.key, _as_key(root, typed))
    if step is not None:
      compat.set_variable_value(stream.count, jnp.asarray(step, jnp.uint32))
  return len(streams)


def _typed(key: Any) -> bool:
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def _as_key(key: Any, typed: bool) -> Any:
  """`key` as a typed key array (`typed`) or as raw key data."""
  if typed and not _typed(key):
    return jax.random.wrap_key_data(key)
  if not typed and _typed(key):
    return jax.random.key_data(key)
  return key


def _resolve(stream: nnx.RngStream) -> None:
  """A seeded stream's key made the one Linen's apply receives (per layer where stacked)."""
  from parity.core import rng

  layers, from_step = getattr(stream, _PENDING)
  key = stream.key[...]
  typed = _typed(key)
  if from_step:
    key = rng.step_key(_as_key(key, False), stream.count[...], 0)
  if layers:
    key = jax.random.split(key, layers)
  compat.set_variable_value(stream.key, _as_key(key, typed))
  if from_step or layers:  # the count back to the stream's shape (its value is not drawn from)
    compat.set_variable_value(stream.count, jnp.zeros((layers,) if layers else (), jnp.uint32))


@contextlib.contextmanager
def resolving_seeds(model_class: type) -> Iterator[None]:
  """While active, a call of `model_class` first resolves the streams `seed_held_streams` seeded
  in the model it is called on, once per trace: the key derivation then stands in the model's
  call, inside the user's own step, where the Linen side derives its key."""
  original = model_class.__dict__.get('__call__')
  resolved: list = []  # the streams resolved, kept alive so that their ids stay theirs

  def __call__(self, *args, **kwargs):
    for _, stream in held_streams(self):
      if getattr(stream, _PENDING, None) is not None and not any(stream is r for r in resolved):
        _resolve(stream)
        resolved.append(stream)
    if original is not None:
      return original(self, *args, **kwargs)
    return super(model_class, self).__call__(*args, **kwargs)

  model_class.__call__ = __call__
  try:
    yield
  finally:
    if original is None:
      del model_class.__call__
    else:
      model_class.__call__ = original


def clear_seeds(model: nnx.Module) -> None:
  """The seeding marks taken off the streams of `model` (after the step they were for)."""
  for _, stream in held_streams(model):
    if getattr(stream, _PENDING, None) is not None:
      object.__setattr__(stream, _PENDING, None)
