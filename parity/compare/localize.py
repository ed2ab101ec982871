"""The divergence localizer: which module first computes something different.

Each side's train-mode loss is traced once with every module call recorded
(parity/compare/bridged.py: Linen's `nn.intercept_methods`; NNX, each module
class's methods patched for the duration of the trace; through any wrapper
between the frameworks): `__call__` and the public methods a caller calls
(`Embed.attend`, a call keyed `embed.attend`), each with every array it was
given, positional or keyword, by its parameter's name. A zero probe is added
to every module's output, so one `value_and_grad` gives, per module call, its
arguments, its forward output, the cotangent arriving at that output, and
every parameter's gradient. `localize` then compares both sides bitwise:

- forward: the first difference in execution order, a call's arguments as it
  starts or its output as it returns. An output that differs from equal
  arguments names its module; an argument that differs while every earlier
  call agrees names the module whose call made it (its caller: the
  difference arose in that module's own code, between its submodules) and
  the argument, never the module that received it;
- backward: a module whose output cotangent is equal on both sides but
  whose parameters' gradients differ computes its own backward pass
  differently; the innermost such module is named (of several at one depth,
  the one the backward pass runs first).

Module calls inside a transform's body are that body's tracers. `localize_step`
probes with the bodies of `jax.lax.scan` and `jax.checkpoint` opened
(`layers_opened`): their calls leave as extra outputs of the body, a scan's
stacked by layer, so each layer of a scanned stack (Linen `nn.scan`, NNX
`nnx.scan` or `jax.lax.scan` over `nnx.split` state, rematerialised or not,
its layer behind a wrapper or not) is compared on its own, `layers/1/mlp`,
and a stacked parameter's gradient layer by layer. Calls inside other
transforms are listed as not recorded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import tracers

from parity.core import paths
from parity.pairs import adapter
from parity.core import bitwise
from parity.compare import bridged
from parity.compare import scopes
from parity.core import compat

ROOT = '(model)'
_LAYER = re.compile(r'(^|/)layers_(\d+)(/|$)')
_SCANNED_LAYER = re.compile(r'(^|/)(\d+)(?=/|$)')


def _float_tree(y: Any) -> Any:
  return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None, y)


def _call_name(path: str, method: str) -> str:
  """A call's name before its repeat count: the module's path, `.method` after it for a
  method other than `__call__` (`embed.attend`)."""
  return (path or ROOT) if method == '__call__' else f'{path or ROOT}.{method}'


def _split_call(key: str) -> tuple[str, str]:
  """(the module's path, what follows it: `.method`, `#n`) of a call's key."""
  head, sep, last = key.rpartition('/')
  cut = min((i for i in (last.find('.'), last.find('#')) if i >= 0), default=len(last))
  return head + sep + last[:cut], last[cut:]


# The layer index of a call inside a scanned body, in its key until the scan's outputs are
# taken apart by layer (`_expand`).
_LAYER_MARK = '<layer>'


def _expand(key: str, layer: int) -> str:
  """`key` of the call in layer `layer` (the innermost scan's mark replaced by the index)."""
  head, mark, tail = key.rpartition(_LAYER_MARK)
  return f'{head}{layer}{tail}' if mark else key


def _arrays(y: Any) -> Any:
  """`y` with every leaf that is not an array as None (what a traced function can return);
  a module or variable in it is not looked into."""
  return jax.tree.map(lambda a: a if isinstance(a, jax.Array) else None, y, is_leaf=bridged._opaque)


class _Frame:
  """The calls recorded in one trace: the probe's own, or a transformed body's (`Recorder.opened`)."""

  def __init__(self, trace: Any, probes: dict[str, Any] | None, scan: bool = False, stack: str | None = None):
    self.trace = trace
    self.probes = probes  # key -> the zero probe added to the call's output (None: the shapes pass)
    self.scan = scan
    # A scan's: the stack's path, the first module called in its body, or what that shares with
    # the parameters the scan slices where the body calls a layer's submodule first (`stack`).
    self.root: str | None = None
    self.stack = stack  # a scan's: the modules of the parameters it slices, their common path
    self.outputs: dict[str, Any] = {}
    self.inputs: dict[str, Any] = {}  # each call's arrays, by argument name (bridged.Arguments.named)
    self.order: list[str] = []  # the calls as they return
    self.events: list[tuple[str, str]] = []  # ('call' | 'return', key) in execution order
    self.callers: dict[str, str] = {}  # key -> the recorded call under way when it started
    # key -> the call as it was made, where `call_key` named it otherwise (an NNX call's own
    # name, its path renamed into Linen's: `dropout#1` for Linen's `Dropout_1`)
    self.made_as: dict[str, str] = {}


class _Bodies:
  """What one probe's two traces share: the keys each opened body recorded on the shapes pass
  (in trace order), so that the probed pass hands each body the probes of its calls."""

  def __init__(self):
    self.keys: dict[int, list[str]] = {}
    self.count = 0


class Recorder:
  """Names each module call and adds its probe; collects outputs during one trace.

  `opened` (the localizer's own probes, `localize_step`): the bodies of `jax.lax.scan` and
  `jax.checkpoint` (what Linen's `nn.scan` and `nn.remat`, NNX's `nnx.scan` and `nnx.remat`,
  and hand-written NNX stacks call) record their module calls too, as extra outputs of the
  body: a scan's stacked along the layer axis, each layer's call then named by its index
  after the stack's path (`layers/1/mlp`: the stack is the first module called in the body).
  Otherwise such calls are the body's tracers and go to `unrecorded`.
  """

  def __init__(self, probes: dict[str, Any] | None, call_key: Callable[[str], str] = lambda key: key,
               bodies: _Bodies | None = None):
    self.call_key = call_key  # the key of a call (`path`, `path#n` for its n-th repeat) on the other side
    self.root = _Frame(tracers.current_trace(), probes)
    self.frames = [self.root]
    self.bodies = bodies
    if bodies is not None:
      bodies.count = 0
    self.unrecorded: list[str] = []
    self.recorded_paths: set[str] = set()
    self._calls: dict[str, int] = {}
    self._active: list[str | None] = []  # keys of the module calls under way (None: not recorded)
    self._callers: list[str | None] = []  # their keys as recorded (None: not recorded)
    self.params: dict[int, str] = {}  # id of each parameter leaf traced -> its gradient's name
    # stack path -> the parameters its scan slices by layer (inputs on axis 0; none for a loop,
    # an RNN's over steps), stacks outside any other transformed body
    self.stacked: dict[str, tuple[str, ...]] = {}

  @property
  def outputs(self) -> dict[str, Any]:
    return self.root.outputs

  @property
  def inputs(self) -> dict[str, Any]:
    return self.root.inputs

  @property
  def order(self) -> list[str]:
    return self.root.order

  def call(self, path: str, args: Any, run: Callable[[], Any]) -> Any:
    """`run()`, the module call at `path` (`args`: its `bridged.Arguments`, or its positional
    arguments); its arguments and output recorded (the output probed) where they can be."""
    call = args if isinstance(args, bridged.Arguments) else bridged.Arguments('__call__', tuple(args), {})
    name = _call_name(path, call.method)
    frame = self.frames[-1]
    here = tracers.current_trace() == frame.trace
    if here:
      scan = next((f for f in reversed(self.frames) if f.scan), None)
      if scan is not None and scan.root is None:
        scan.root = (_common_path(path, scan.stack) or path) if scan.stack is not None else path
    key = self._key(name) if here else None
    # A lifted transform calling its module (Linen's nn.remat, inside its body): one call.
    repeat = key is not None and bool(self._active) and self._active[-1] == key
    recorded = self._start(frame, path, key, call) if key is not None and not repeat else None
    self._active.append(None if repeat else key)
    self._callers.append(recorded)
    try:
      y = run()
    finally:
      self._active.pop()
      self._callers.pop()
    if not here:
      if (path or ROOT) not in self.unrecorded:
        self.unrecorded.append(path or ROOT)
      return y
    if repeat:
      return y
    return self._finish(frame, recorded, y)

  def _key(self, name: str) -> str:
    """The call's key before its repeat count: the name, with a layer mark after the stack's path
    for each scan it runs in (`layers/<layer>/mlp`)."""
    path, suffix = _split_call(name)
    key = path if path != ROOT else ''
    for frame in reversed(self.frames):  # innermost first: its stack is the deepest
      if frame.scan and frame.root is not None:
        key = _marked(key, path if path != ROOT else '', frame.root)
    return (key or ROOT) + suffix

  def _start(self, frame: _Frame, path: str, key: str, call: bridged.Arguments) -> str:
    """The key of a call as it starts (the other side's, its layer marks put back), its
    arguments and its caller recorded."""
    n = self._calls.get(key, 0)
    self._calls[key] = n + 1
    name = _call_name(path, call.method)
    made = name if n == 0 else f'{name}#{n}'
    key = self._key(self.call_key(made))
    if self._key(made) != key:
      frame.made_as[key] = self._key(made)
    self.recorded_paths.add(path or ROOT)
    frame.events.append(('call', key))
    named = call.named()
    if named:
      frame.inputs[key] = named
    caller = next((k for k in reversed(self._callers) if k is not None), None)
    if caller is not None:
      frame.callers[key] = caller
    return key

  def _finish(self, frame: _Frame, key: str, y: Any) -> Any:
    """`y`, the output of the call `key`, recorded (its probe added)."""
    frame.order.append(key)
    frame.events.append(('return', key))
    if frame.probes is not None and key in frame.probes:
      y = jax.tree.map(lambda a, p: a if p is None else a + p.astype(a.dtype), y, frame.probes[key],
                       is_leaf=lambda x: x is None or bridged._opaque(x))
    frame.outputs[key] = _arrays(y)
    return y

  # -- transformed bodies, opened --------------------------------------------------------

  def _body(self) -> tuple[_Frame, int, list[str]] | None:
    """(the frame calling a transform, the body's number, its keys on the shapes pass); None
    where the transform is called from a trace no frame records (it then runs as it is)."""
    parent = self.frames[-1]
    if self.bodies is None or tracers.current_trace() != parent.trace:
      return None
    number = self.bodies.count
    self.bodies.count += 1
    return parent, number, self.bodies.keys.get(number, [])

  def _run_body(self, number: int, probes: Any, scan: bool, fn: Callable[[], Any],
                stack: str | None = None) -> tuple[_Frame, Any]:
    frame = _Frame(tracers.current_trace(), probes, scan, stack)
    self.frames.append(frame)
    try:
      out = fn()
    finally:
      self.frames.pop()
    self.bodies.keys[number] = list(frame.outputs)
    return frame, out

  def scan(self, original: Callable, f, init, xs=None, length=None, reverse=False, unroll=1, **kwargs):
    """`jax.lax.scan`, its body's calls recorded as outputs stacked by layer, their probes as
    inputs stacked alike."""
    body = self._body()
    if body is None:
      return original(f, init, xs, length, reverse, unroll, **kwargs)
    parent, number, keys = body
    layers = length if length is not None else jax.tree.leaves(xs)[0].shape[0]
    probes = None
    if parent.probes is not None:
      stack = lambda *p: jnp.stack(p)  # noqa: E731
      probes = {k: jax.tree.map(stack, *[parent.probes[_expand(k, i)] for i in range(layers)])
                for k in keys if all(_expand(k, i) in parent.probes for i in range(layers))}
    frames, calls, count = [], dict(self._calls), self.bodies.count
    # The modules whose parameters the scan slices by layer (none: a loop), as one path.
    sliced = [self.params[id(x)][len('params/'):].rsplit('/', 1)[0]
              for x in jax.tree.leaves(xs) if id(x) in self.params]
    stack = functools.reduce(_common_path, sliced) if sliced else None

    def scanned(carry, packed):
      x, probes = packed
      # A body traced again (a carry's weak type changed) names and numbers its calls alike.
      self._calls, self.bodies.count = dict(calls), count
      frame, (carry, y) = self._run_body(number, probes, True, lambda: f(carry, x), stack)
      frames[:] = [frame]
      return carry, (y, frame.outputs, frame.inputs)

    carry, (ys, outputs, inputs) = original(scanned, init, (xs, probes), length, reverse, unroll, **kwargs)
    if parent is self.root and frames[0].root is not None:
      # Its layers' calls: `<root>/<layer>/...`; a scan slicing no parameters (`()`) is a loop.
      self.stacked[frames[0].root] = tuple(
          self.params[id(x)] for x in jax.tree.leaves(xs) if id(x) in self.params)
    order = range(layers - 1, -1, -1) if reverse else range(layers)
    body = frames[0]
    parent.order += [_expand(k, i) for i in order for k in body.order]
    parent.events += [(kind, _expand(k, i)) for i in order for kind, k in body.events]
    own = set(body.order)  # a caller outside the body has no mark of this scan
    parent.callers.update({_expand(k, i): _expand(c, i) if c in own else c
                           for i in order for k, c in body.callers.items()})
    parent.made_as.update({_expand(k, i): _expand(m, i) for i in order for k, m in body.made_as.items()})
    for got, into in ((outputs, parent.outputs), (inputs, parent.inputs)):
      for k, v in got.items():
        into.update({_expand(k, i): jax.tree.map(lambda a: a[i], v) for i in range(layers)})
    return carry, ys

  def checkpoint(self, original: Callable, fun=None, **options):
    """`jax.checkpoint`, its body's calls recorded as its outputs, their probes as inputs."""
    if fun is None:
      return functools.partial(self.checkpoint, original, **options)
    static = options.get('static_argnums', ())
    static = (static,) if isinstance(static, int) else tuple(static)

    @functools.wraps(fun)
    def call(*args, **kwargs):
      body = self._body()
      if body is None:
        return original(fun, **options)(*args, **kwargs)
      parent, number, keys = body
      probes = None if parent.probes is None else {k: parent.probes[k] for k in keys if k in parent.probes}

      def inner(probes, *args, **kwargs):
        frame, out = self._run_body(number, probes, False, lambda: fun(*args, **kwargs))
        frames[:] = [frame]
        return out, (frame.outputs, frame.inputs)

      frames = []
      shifted = dict(options, static_argnums=tuple(i + 1 if i >= 0 else i for i in static))
      out, (outputs, inputs) = original(inner, **shifted)(probes, *args, **kwargs)
      parent.order += frames[0].order
      parent.events += frames[0].events
      parent.callers.update(frames[0].callers)
      parent.made_as.update(frames[0].made_as)
      parent.outputs.update(outputs)
      parent.inputs.update(inputs)
      return out

    return call

  @contextlib.contextmanager
  def opened(self):
    """While active, `jax.lax.scan` and `jax.checkpoint` (`jax.remat`) record their bodies' calls."""
    if self.bodies is None:
      yield
      return
    scan, checkpoint, remat = jax.lax.scan, jax.checkpoint, jax.remat
    try:
      jax.lax.scan = functools.partial(self.scan, scan)
      jax.checkpoint = functools.partial(self.checkpoint, checkpoint)
      jax.remat = functools.partial(self.checkpoint, remat)
      yield
    finally:
      jax.lax.scan, jax.checkpoint, jax.remat = scan, checkpoint, remat

  def name_params(self, params: Any, name: Callable[[str], str]) -> None:
    """Lets an opened scan tell which parameters it slices by layer (its inputs, on axis 0):
    each parameter leaf of this trace by its id, named as the probe names its gradient."""
    if self.bodies is not None:
      self.params = {id(x): name(p) for p, x in paths.flatten(params).items()}

  def unrecorded_calls(self) -> tuple[str, ...]:
    """The calls seen only where they cannot be recorded (a body traced outside its transform,
    as Linen's nn.scan traces its body once more to check it)."""
    return tuple(p for p in self.unrecorded if p not in self.recorded_paths)


def _common_path(a: str, b: str) -> str:
  """The longest module path both `a` and `b` are under ('' for none)."""
  common = []
  for x, y in zip(a.split('/'), b.split('/')):
    if x != y:
      break
    common.append(x)
  return '/'.join(common)


def _marked(key: str, path: str, root: str) -> str:
  """`key` (of the call at `path`) with a layer mark after the stack's path: `root`, or what
  `path` shares with it where the call is not under it."""
  if not (path == root or path.startswith(root + '/') or not root):
    root = _common_path(path, root)
  if not root:
    return f'{_LAYER_MARK}/{key}' if key else _LAYER_MARK
  # The stack's path is a prefix of `path`; in `key` earlier marks may precede it.
  depth = root.count('/') + 1
  parts = key.split('/')
  seen = i = 0
  while seen < depth:
    if parts[i] != _LAYER_MARK:
      seen += 1
    i += 1
  return '/'.join(parts[:i] + [_LAYER_MARK] + parts[i:])


def _zeros_like(shapes: dict[str, Any]) -> dict[str, Any]:
  return {
      k: jax.tree.map(lambda s: None if s is None else jnp.zeros(s.shape, s.dtype), v,
                      is_leaf=lambda x: x is None)
      for k, v in shapes.items()
  }


def flat_outputs(tree: dict[str, Any]) -> dict[str, Any]:
  """Each call's output leaves, `key:sub`; a call's only leaf by its key alone (a Linen
  scanned layer returns `(x, None)` where an NNX one returns `x`)."""
  out = {}
  for key, y in tree.items():
    leaves = [(sub, leaf) for sub, leaf in paths.items(y) if leaf is not None]
    if len(leaves) == 1:
      out[key] = leaves[0][1]
      continue
    for sub, leaf in leaves:
      out[key if not sub else f'{key}:{sub}'] = leaf
  return out


# ---------------------------------------------------------------------------
# Linen
# ---------------------------------------------------------------------------


def _on_call(recorder: Recorder) -> bridged.OnCall:
  """A module call recorded by `recorder`; a Linen module's `init` is not (it is not the
  computation compared: a decode's cache is made by one, as flax does)."""

  def on_call(path, module, args, run):
    if isinstance(module, nn.Module) and module.is_initializing():
      return run()
    return recorder.call(path, args, run)

  return on_call


@contextlib.contextmanager
def linen_intercept(recorder: Recorder):
  """Records each module call (`__call__` and public methods; through any wrapper between the
  frameworks: parity/compare/bridged.py), except inside a lifted transform's body (`nn.scan`,
  `nn.remat`, ...) that the recorder has not opened: its values are the body's tracers, which
  cannot leave it (their paths go to `unrecorded`)."""
  with bridged.linen_calls(_on_call(recorder)), recorder.opened():
    yield


# Set by `layers_opened`: the probes record the module calls inside scanned and
# rematerialised bodies (`Recorder`), each layer of a stack by its index.
_OPENED = [False]


@contextlib.contextmanager
def layers_opened():
  """While active, `linen_probe` and `nnx_probe` record the module calls inside `jax.lax.scan`
  and `jax.checkpoint` bodies (Linen `nn.scan`, `nn.remat`; NNX `nnx.scan`, `nnx.remat`, and
  `jax.lax.scan` over `nnx.split` state), a stack's layers named by their index
  (`layers/1/mlp`); `localize_step` probes so."""
  before = _OPENED[0]
  _OPENED[0] = True
  try:
    yield
  finally:
    _OPENED[0] = before


def linen_probe(loss: Callable, has_aux: bool, state: Any, batch: Any, dropout_key: Any) -> adapter.Probe:
  """The probe of a stock-TrainState side: loss(params, state, batch, key)."""
  bodies = _Bodies() if _OPENED[0] else None

  def traced(params, probes, state, batch, dropout_key):
    recorder = Recorder(probes, bodies=bodies)
    recorder.name_params(params, lambda p: 'params/' + p)
    with linen_intercept(recorder):
      value = loss(params, state, batch, dropout_key)
    value = value[0] if has_aux else value
    seen[:] = [recorder]
    return value, (recorder.outputs, recorder.inputs)

  seen: list[Recorder] = []
  probe = _probe(
      traced, seen, state.params, (state, batch, dropout_key),
      lambda p: {'params/' + k: g for k, g in paths.flatten(p).items()},
  )
  return probe


# ---------------------------------------------------------------------------
# NNX
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def nnx_intercept(model: nnx.Module, recorder: Recorder, rename: Callable[[str], str]):
  """Each module class's `__call__` and public methods wrapped (restored on exit); outermost
  call per instance recorded (through any wrapper between the frameworks), except inside a
  transform's body (`nnx.remat`, `nnx.scan`, ...) that the recorder has not opened, whose
  module copies (named by their originals' tags, parity/compare/scopes.py) compute the
  body's tracers: their paths go to `unrecorded`, as on the Linen side."""
  scopes.tag_paths(model, rename)
  with bridged.nnx_calls(_on_call(recorder), rename), recorder.opened():
    yield


def nnx_probe(
    loss: Callable, graphdef: Any, state: Any, batch: Any, dropout_key: Any, renames,
    prefix: str = 'params/', to_linen: Callable = lambda path, x: x,
    call_key: Callable[[str], str] = lambda key: key,
) -> adapter.Probe:
  """The probe of a stock NNX side: loss(model, batch, key) on the merged (model, optimizer).

  `call_key` maps a recorded call's key (its Linen path by `renames`, `#n`
  for the n-th repeat of one module's call) to Linen's, where one NNX module
  called twice is two Linen modules.
  """
  # The (model, optimizer) state split so that only the model's parameters
  # are differentiated (the optimizer holds no nnx.Param).
  params, rest = nnx.split_state(state, nnx.Param, ...)
  bodies = _Bodies() if _OPENED[0] else None
  name = lambda k: prefix + renames.to_linen(k[2:])  # noqa: E731

  def traced(params, probes, rest, batch, dropout_key):
    # Fresh Variables of this trace (merge reuses the state's own, which
    # belong to the caller's trace and refuse the in-place batch-stat update).
    params, rest = jax.tree.map(lambda x: x, (params, rest))
    with compat.eager_sharding_off():
      model, _ = nnx.merge(graphdef, params, rest)
    recorder = Recorder(probes, call_key, bodies)
    recorder.name_params(params, name)
    with nnx_intercept(model, recorder, renames.to_linen):
      value = loss(model, batch, dropout_key)
    seen[:] = [recorder]
    return value, (recorder.outputs, recorder.inputs)

  seen: list[Recorder] = []
  probe = _probe(
      traced, seen, params, (rest, batch, dropout_key),
      lambda p: {name(k): to_linen(k[2:], g) for k, g in paths.flatten(p).items()},
  )
  to_nnx = getattr(renames, 'to_nnx', lambda path: path)
  return dataclasses.replace(probe, unrecorded=tuple(call_key(u) for u in probe.unrecorded),
                             nnx_names=nnx_names(probe.order, seen[0].root.made_as, to_nnx))


def nnx_names(keys, made_as: dict[str, str], to_nnx: Callable[[str], str]) -> dict[str, str]:
  """Of the NNX calls recorded under Linen's `keys`, each one's NNX name where it is not the
  Linen one: the call as it was made (`made_as`), its module path renamed back to NNX's
  (`to_nnx`, the pair's renames: Linen's `LayerNorm_1` is NNX's `ln2`)."""
  out = {}
  for key in keys:
    module, suffix = _split_call(made_as.get(key, key))
    own = (module if module == ROOT else _layer_renamed(module, to_nnx)) + suffix
    if own != key:
      out[key] = own
  return out


def _layer_renamed(module: str, to_nnx: Callable[[str], str]) -> str:
  """`to_nnx(module)` for a module inside a scanned body, `<stack>/<i>/<rest>` (the layer, or the
  step, i of the loop): the renames are of paths without the index, which goes back after the
  stack's NNX path."""
  parts = module.split('/')
  at = next((i for i, part in enumerate(parts) if i and part.isdigit()), None)
  if at is None:
    return to_nnx(module)
  stack, plain = to_nnx('/'.join(parts[:at])), to_nnx(module)
  whole = to_nnx('/'.join(parts[:at] + parts[at + 1:]))
  # A rename of the index itself (a Linen module named '0') stands as the renames give it.
  if at + 1 < len(parts) and whole.startswith(stack + '/') and plain.startswith(f'{stack}/{parts[at]}/'):
    return f'{stack}/{parts[at]}{whole[len(stack):]}'
  return plain


# ---------------------------------------------------------------------------


def _probe(traced: Callable, seen: list[Recorder], params: Any, args: tuple,
           name_grads: Callable) -> adapter.Probe:
  """Outputs, output cotangents and parameter gradients of one traced loss.

  `traced(params, probes, *args) -> (loss, outputs)` leaves its recorder in `seen`
  each time it is traced (the module calls in execution order, the calls it could not record).
  """
  _, (shapes, _) = jax.eval_shape(lambda p, a: traced(p, None, *a), params, args)
  shapes = {k: _float_tree(v) for k, v in shapes.items()}

  def loss_and_grads_probe(params, args):  # its program's name in `--parity-programs`
    grad = jax.value_and_grad(traced, argnums=(0, 1), has_aux=True)
    (loss, (outputs, inputs)), (param_grads, cotangents) = grad(params, _zeros_like(shapes), *args)
    return loss, outputs, inputs, cotangents, param_grads

  loss, outputs, inputs, cotangents, param_grads = jax.jit(loss_and_grads_probe)(params, args)
  recorder = seen[0]
  return RecordedProbe(
      loss=loss,
      order=list(recorder.order),
      inputs=dict(inputs),
      outputs=flat_outputs(outputs),
      cotangents=flat_outputs(cotangents),
      param_grads=name_grads(param_grads),
      unrecorded=recorder.unrecorded_calls(),
      events=list(recorder.root.events),
      callers=dict(recorder.root.callers),
      stacked=dict(recorder.stacked),
  )


@dataclasses.dataclass(frozen=True)
class RecordedProbe(adapter.Probe):
  """A probe as the recorder makes it: `inputs`, each call's arrays by argument name;
  `events`, ('call' | 'return', key) in execution order (a call's arguments are compared
  as it starts); `callers`, each call's caller (the module whose code made its arguments);
  `stacked`, each opened stack's path -> the parameters its scan slices by layer on axis 0
  (their gradients are compared layer by layer in the backward pass; none: a loop, which
  slices none); `nnx_names`, an NNX
  probe's calls by their NNX names, keyed by Linen's, where the two differ (`nnx_probe`)."""

  # The loss the gradients are of: the grads part reads it and `param_grads` (one program per
  # side serves the grads part and the localizer).
  loss: Any = None
  events: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  callers: dict[str, str] = dataclasses.field(default_factory=dict)
  stacked: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  # An NNX probe's: each call's NNX name (module path and call) where Linen names it otherwise.
  nnx_names: dict[str, str] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Localization:
  forward: str | None  # the module whose forward computation first differs
  forward_call: str | None  # the first module call whose output (or, inside, an argument) differs
  forward_inside: bool  # True: `forward` differs between its submodules' calls, not in one of them
  forward_ulp: int | None  # max ULP of the first differing value (an argument, inside); None: see _max_ulp
  backward: list[tuple[str, list[str]]]  # (module, its parameters whose gradients differ)
  only_linen: list[str]
  only_nnx: list[str]
  details: dict[str, str]  # path -> bitwise detail of the first differing values
  # True where each call of `only_linen` and `only_nnx` is of a module the other side records calls
  # under but does not call itself (an NNX stack's layer whose scan body calls its submodule): its
  # submodules' calls are compared, and no body went unopened.
  only_containers: bool = False
  backward_ulp: dict[str, int | None] = dataclasses.field(default_factory=dict)  # module -> max ULP (None: see _max_ulp)
  compared_calls: int = 0  # module calls found on both sides (their outputs compared)
  compared_grads: int = 0  # parameter gradients found on both sides
  only_linen_grads: list[str] = dataclasses.field(default_factory=list)
  only_nnx_grads: list[str] = dataclasses.field(default_factory=list)
  # The first place the module calls found on both sides come in another order:
  # (index among them, Linen's call there, NNX's call there); None: the same order.
  order_difference: tuple[int, str, str] | None = None
  unrecorded: tuple[str, ...] = ()  # modules called inside a transformed body, either side (adapter.Probe)
  # With `forward_inside`: the outermost unrecorded calls inside `forward`, where the
  # difference may have arisen as well as in its own code.
  forward_unrecorded: tuple[str, ...] = ()
  # With `forward_inside`: the argument of `forward_call` that differs (its name in the
  # method's signature, Linen's), made by `forward`'s code.
  forward_argument: str | None = None
  # Linen call key -> the NNX name of the same call, where they differ (RecordedProbe.nnx_names):
  # the lines name a module by both sides' paths, `LayerNorm_1 (NNX: ln2)`.
  nnx_names: dict[str, str] = dataclasses.field(default_factory=dict)
  # The two probes compared (Linen's, NNX's): `localize_step` keeps them for the grads part.
  probes: tuple[Any, ...] | None = dataclasses.field(default=None, repr=False)
  # The opened scans that slice no parameters by their index (a recurrent cell's loop over time
  # steps, not a stack of layers): a module inside one is reported with its iteration.
  loops: tuple[str, ...] = ()
  # 'Linen' or 'NNX': the side whose `forward_call` returned its input unchanged where the
  # other's did not (a dropout off in this mode, a layer skipped); None: neither, or both.
  forward_unchanged: str | None = None

  def _call(self, key: str) -> str:
    """A call's key, with its NNX name after it where that differs."""
    own = self.nnx_names.get(key)
    return key if own is None else f'{key} (NNX: {own})'

  def _module(self, module: str) -> str:
    """A module's Linen path, with its NNX path after it where that differs (read off its
    first call found, `__call__` first)."""
    calls = [module] + [k for k in self.nnx_names if k != module and _module_of(k) == module]
    own = next((_module_of(self.nnx_names[k]) for k in calls if k in self.nnx_names), None)
    return module if own is None or own == module else f'{module} (NNX: {own})'

  def unchanged_note(self) -> str:
    """What `forward_unchanged` tells, after a forward difference's line ('' where it is None)."""
    if self.forward_unchanged is None:
      return ''
    return (f'; {self.forward_unchanged}\'s call returned its input unchanged and the other side\'s did'
            ' not: a dropout off in this mode (deterministic), or a layer skipped')

  def first(self, step: int | None = None) -> dict[str, Any] | None:
    """The first divergent module: `{step, path, layer, iteration, pass, max_ulp}` (None: none
    found).

    A layer of a stack (`.../layers_<i>/...`, as the unscanned twin of a
    scanned stack names it; `<stack>/<i>/...`, a scanned stack's layer as the
    opened probes name it) is reported as the stack's path with its index as
    `layer`; a module inside a loop that slices no parameters (`loops`: an
    RNN's steps), with its index as `iteration`.
    """
    if self.forward is not None:
      module, pass_name, ulp = self.forward, 'forward', self.forward_ulp
    elif self.backward:
      module = self.backward[0][0]
      pass_name, ulp = 'backward', self.backward_ulp[module]
    else:
      return None
    iteration = None
    m = _LAYER.search(module)
    if m is not None:
      layer = int(m.group(2))
      path = module[:m.start()] + m.group(1) + 'layers' + m.group(3) + module[m.end():]
    else:  # a layer of an opened scan, `<stack>/<layer>/...`, or an iteration of a loop
      m = _SCANNED_LAYER.search(module)
      layer = None if m is None else int(m.group(2))
      path = module if m is None else (module[:m.start()] + module[m.end():]).lstrip('/')
      if m is not None and module[:m.start()] in self.loops:
        layer, iteration = None, layer
    return {'step': step, 'path': path.rstrip('/'), 'layer': layer, 'iteration': iteration,
            'pass': pass_name, 'max_ulp': ulp}

  @property
  def clean(self) -> bool:
    return self.forward is None and not self.backward

  def lines(self) -> list[str]:
    out = []
    if self.forward is not None and self.forward_inside and _module_of(self.forward_call) == ROOT:
      out.append(
          f'forward pass: the input of {self.forward_call} differs ({self.details[self.forward_call]}):'
          ' the sides call the model with other arguments, made outside every recorded module call'
      )
    elif self.forward is not None and self.forward_inside and self.forward_unrecorded:
      out.append(
          f'forward pass: inside module {self._module(self.forward)}: the input of'
          f' {self._call(self.forward_call)} differs'
          f' while every earlier recorded call agrees ({self.details[self.forward_call]}); it arose'
          f' in a call not recorded there, {_shown(self.forward_unrecorded)} (inside a transformed'
          f' body), or in {self.forward}\'s own code between its submodules'
      )
    elif self.forward is not None and self.forward_inside:
      out.append(
          f'forward pass: inside module {self._module(self.forward)}, outside its submodules: the'
          f' input of {self._call(self.forward_call)} differs while every earlier call agrees'
          f' ({self.details[self.forward_call]})'
      )
    elif self.forward is not None:
      method = _method_of(self.forward_call)
      shown = f'module {self._module(self.forward)}' + (f', in its method {method}' if method else '')
      out.append(f'forward pass: first differs at {shown} ({self.details[self.forward_call]}){self.unchanged_note()}')
    else:
      out.append('forward pass: every module output bitwise equal')
    for module, params in self.backward:
      shown = ', '.join(f'{p} ({self.details[p]})' for p in params)
      out.append(
          f'backward pass: inside module {self._module(module)}: output cotangent bitwise equal,'
          f' gradients differ: {shown}'
      )
    if not self.backward:
      out.append('backward pass: every parameter gradient bitwise equal'
                 if self.forward is None else 'backward pass: not localized (the forward differs)')
    if self.order_difference is not None:
      i, a, b = self.order_difference
      out.append(f'module calls in another order: call {i} of those on both sides is {a} in Linen,'
                 f' {self._call(b)} in NNX (a rename rule that maps an NNX module to another Linen path'
                 ' reads so)')
    if self.unrecorded:
      out.append(f'not recorded: module calls inside a transformed body (Linen nn.scan, nn.remat;'
                 f' NNX nnx.scan, nnx.remat, ...), whose values cannot leave it:'
                 f' {_shown(self.unrecorded)}; a difference there shows in the input of the first'
                 ' recorded call after them, and in their parameters\' gradients')
    if self.only_linen or self.only_nnx:
      out.append(f'unmatched module calls: linen {self.only_linen}, nnx {self.only_nnx}'
                 ' (add rename rules to compare them)')
    if self.only_linen_grads or self.only_nnx_grads:
      out.append(f'unmatched parameter gradients: linen {self.only_linen_grads},'
                 f' nnx {self.only_nnx_grads} (add rename rules to compare them)')
    return out

  @property
  def unmatched(self) -> list[str]:
    """What the localizer could not compare: calls or gradients on one side only, or nothing at all."""
    out = []
    if self.only_linen or self.only_nnx:
      out.append(f'module calls on one side only: linen {self.only_linen}, nnx {self.only_nnx}')
    if self.only_linen_grads or self.only_nnx_grads:
      out.append(f'parameter gradients on one side only: linen {self.only_linen_grads},'
                 f' nnx {self.only_nnx_grads}')
    if not self.compared_calls:
      out.append('no module call found on both sides')
    if not self.compared_grads:
      out.append('no parameter gradient found on both sides')
    return out


def _shown(names, most: int = 5) -> str:
  return ', '.join(names[:most]) + (f' and {len(names) - most} more' if len(names) > most else '')


def _outermost_inside(module: str, calls) -> tuple[str, ...]:
  """Of `calls` (module paths), those inside `module` that are not inside another of them."""
  inside = [c for c in calls if module == ROOT or c.startswith(module + '/')]
  return tuple(c for c in inside if not any(c.startswith(o + '/') for o in inside))


def _module_of(key: str) -> str:
  """The module of a call's key (or of one of its outputs, `key:sub`)."""
  return _split_call(key.split(':', 1)[0])[0]


def _method_of(key: str) -> str | None:
  """The method of a call's key (None: `__call__`)."""
  suffix = _split_call(key.split(':', 1)[0])[1]
  return suffix[1:].split('#', 1)[0] if suffix.startswith('.') else None


def _depth(module: str) -> int:
  return 0 if module == ROOT else module.count('/') + 1


def _under(param: str, module: str) -> bool:
  p = param[len('params/'):]
  return module == ROOT or p.startswith(module + '/')


def localize_step(
    linen: adapter.Side, nnx_side: adapter.Side, linen_state: dict[str, Any], batch: Any, key: Any
) -> Localization:
  """Both sides probed from one state (the checkpoint layout) on one step's placed batch and key.

  The runner and the battery both localize a divergent step this way, from
  the Linen side's state before it, with the layers of scanned stacks opened
  (`layers_opened`).
  """
  states = [side.from_checkpoint(linen_state) for side in (linen, nnx_side)]

  def probed():
    probes = tuple(side.probe(state, batch, key) for side, state in zip((linen, nnx_side), states))
    return dataclasses.replace(localize(*probes), probes=probes)

  try:
    with layers_opened():  # each layer of a scanned stack recorded
      opened = probed()
  except Exception:  # a body the recorder cannot open: probed as it is, its calls not recorded
    return probed()
  if not (opened.only_linen or opened.only_nnx) or opened.only_containers:
    return opened
  # Calls on one side only: a body one side opens where the other's cannot be (a transform
  # made before the probe, say); unopened, both list their calls as not recorded.
  plain = probed()
  return plain if not (plain.only_linen or plain.only_nnx) else opened


def localize(linen: adapter.Probe, nnx_probe: adapter.Probe) -> Localization:
  details: dict[str, str] = {}

  def differs(a, b, key) -> bool:
    d = bitwise.compare_leaves(key, a, b)
    if d is not None:
      details.setdefault(_module_of(key) if ':' in key else key, d.detail)
      details.setdefault(key, d.detail)
    return d is not None

  common = [k for k in linen.order if k in set(nnx_probe.order)]
  nnx_common = [k for k in nnx_probe.order if k in set(linen.order)]
  order_difference = next(
      ((i, a, b) for i, (a, b) in enumerate(zip(common, nnx_common)) if a != b), None)
  forward_call, argument = None, None
  nnx_calls = set(nnx_probe.order)
  # Execution order: a call's arguments as it starts, its output as it returns (a probe
  # without its calls' starts: outputs alone, a differing one's arguments compared then).
  events = getattr(linen, 'events', None) or [('return', k) for k in linen.order]
  starts = any(kind == 'call' for kind, _ in events)
  for kind, call in events:
    if call not in nnx_calls:
      continue
    if kind == 'call':
      argument = _argument_difference(linen.inputs.get(call), nnx_probe.inputs.get(call), call)
      if argument is not None:
        forward_call = call
        break
      continue
    subs = [k for k in linen.outputs if k.split(':')[0] == call]
    if any(k in nnx_probe.outputs and differs(linen.outputs[k], nnx_probe.outputs[k], k) for k in subs):
      forward_call = call
      details.setdefault(call, next(details[k] for k in subs if k in details))
      if not starts:
        argument = _argument_difference(linen.inputs.get(call), nnx_probe.inputs.get(call), call)
      break
  forward, inside, forward_ulp, unchanged = None, False, None, None
  if forward_call is not None and argument is None:
    forward = _module_of(forward_call)
    keys = [k for k in linen.outputs if k.split(':')[0] == forward_call and k in nnx_probe.outputs]
    forward_ulp = _max_ulp((linen.outputs[k], nnx_probe.outputs[k]) for k in keys)
    sides = [name for name, probe in (('Linen', linen), ('NNX', nnx_probe)) if _returns_its_input(probe, forward_call)]
    unchanged = sides[0] if len(sides) == 1 else None
  elif forward_call is not None:
    # An argument differs while every earlier call agrees: the module that made it, its
    # caller, computes otherwise in its own code between its submodules' calls (the one
    # that received it is not to blame).
    name, diff, a, b = argument
    details[forward_call] = f'its argument {name}: {diff.detail}'
    caller = _caller(linen, nnx_probe, forward_call)
    forward, inside, forward_ulp = (ROOT if caller is None else _module_of(caller)), True, bitwise.ulp_distance(a, b)
  cot_equal = {
      call for call in common
      if all(
          k in nnx_probe.cotangents and not differs(linen.cotangents[k], nnx_probe.cotangents[k], k)
          for k in linen.cotangents if k.split(':')[0] == call
      )
  }
  bad = [
      p for p in linen.param_grads
      if p in nnx_probe.param_grads and differs(linen.param_grads[p], nnx_probe.param_grads[p], p)
  ]
  unrecorded = tuple(dict.fromkeys(linen.unrecorded + nnx_probe.unrecorded))
  backward = []
  backward_ulp: dict[str, int | None] = {}
  claimed: set[str] = set()
  # Innermost first: a module claims the differing gradients of its own
  # parameters when its output cotangent is equal; its parents then do not.
  # Modules of one depth in the backward pass's order (the forward's reversed),
  # so the first one named is the same on every run.
  position = {call: i for i, call in enumerate(common)}
  stacked = _stacked(linen, nnx_probe)
  for call in sorted(cot_equal, key=lambda c: (-_depth(_module_of(c)), -position[c])):
    module = _module_of(call)
    layer = _layer_params(module, stacked, [p for p in bad if p not in claimed])
    if layer is not None:  # a layer of a scanned stack: its slice of the stacked gradients
      index, params = layer
      pairs = {p: (linen.param_grads[p][index], nnx_probe.param_grads[p][index]) for p in params}
      mine = [p for p, (a, b) in pairs.items() if differs(a, b, f'{p}@{index}')]
      for p in mine:
        details[p] = f'layer {index}: ' + details[f'{p}@{index}']
    else:
      mine = [p for p in bad if _under(p, module) and p not in claimed]
      pairs = {p: (linen.param_grads[p], nnx_probe.param_grads[p]) for p in mine}
    if mine:
      backward.append((module, mine))
      claimed.update(mine)
      backward_ulp[module] = _max_ulp(pairs[p] for p in mine)
  return Localization(
      forward=forward,
      forward_call=forward_call,
      forward_inside=inside,
      forward_ulp=forward_ulp,
      backward=backward,
      # A call whose counterpart runs inside a transformed body is not missing there.
      only_linen=(only_linen := _one_sided(linen.order, nnx_probe)),
      only_nnx=(only_nnx := _one_sided(nnx_probe.order, linen)),
      only_containers=(all(_contains(k, nnx_probe.order) for k in only_linen)
                       and all(_contains(k, linen.order) for k in only_nnx)),
      details=details,
      backward_ulp=backward_ulp,
      compared_calls=len(common),
      compared_grads=sum(p in nnx_probe.param_grads for p in linen.param_grads),
      only_linen_grads=[p for p in linen.param_grads if p not in nnx_probe.param_grads],
      only_nnx_grads=[p for p in nnx_probe.param_grads if p not in linen.param_grads],
      order_difference=order_difference,
      unrecorded=unrecorded,
      forward_unrecorded=_outermost_inside(forward, unrecorded) if inside else (),
      forward_argument=argument[0] if argument is not None else None,
      nnx_names=dict(getattr(nnx_probe, 'nnx_names', None) or {}),
      loops=_loops(linen, nnx_probe),
      forward_unchanged=unchanged,
  )


def _returns_its_input(probe: adapter.Probe, call: str) -> bool:
  """Whether `call` returned one array bitwise equal to one of its arguments (a dropout that did
  not drop, a layer that passed its input through)."""
  outs = [v for k, v in probe.outputs.items() if k.split(':')[0] == call]
  if len(outs) != 1 or not hasattr(outs[0], 'shape'):
    return False
  out = outs[0]
  return any(hasattr(x, 'shape') and bitwise.compare_leaves(call, x, out) is None
             for x in _arguments(probe.inputs.get(call)).values())


def _one_sided(order: list[str], other: adapter.Probe) -> list[str]:
  """The calls of `order` the other side does not make: neither inside a transformed body
  there, nor a method call (`embed.attend`), which the other side may compute in its
  caller's code (compared where both make it)."""
  made, unrecorded = set(other.order), set(other.unrecorded)
  return [k for k in order if k not in made and _module_of(k) not in unrecorded and _method_of(k) is None]


def _contains(call: str, order: list[str]) -> bool:
  """Whether `order` (the other side's calls) holds calls of modules under `call`'s module."""
  module = _module_of(call)
  return module != ROOT and any(_module_of(k).startswith(module + '/') for k in order)


def _stacked(linen: adapter.Probe, nnx_probe: adapter.Probe) -> dict[str, tuple[str, ...]]:
  """The stacks both probes opened, each with the parameters both slice by layer on axis 0."""
  a, b = getattr(linen, 'stacked', {}), getattr(nnx_probe, 'stacked', {})
  return {stack: tuple(p for p in a[stack] if p in b[stack]) for stack in a if stack in b
          if a[stack] or b[stack]}


def _loops(linen: adapter.Probe, nnx_probe: adapter.Probe) -> tuple[str, ...]:
  """The scans both probes opened that slice no parameters on either side: loops (an RNN's
  over its steps), not stacks of layers."""
  a, b = getattr(linen, 'stacked', {}), getattr(nnx_probe, 'stacked', {})
  return tuple(stack for stack in a if stack in b and not a[stack] and not b[stack])


def _layer_params(module: str, stacked: dict[str, tuple[str, ...]], params: list[str]):
  """(layer index, the stacked parameters of `params` under it) of a module `<stack>/<i>/...`
  in an opened stack; None for a module in none."""
  for stack, sliced in stacked.items():
    head, sep, rest = module.partition('/') if not stack else module[len(stack) + 1:].partition('/')
    if (stack and not module.startswith(stack + '/')) or not head.isdigit():
      continue
    inside = '/'.join(filter(None, (stack, rest)))
    return int(head), [p for p in params if p in sliced and _under(p, inside or ROOT)]
  return None


def _caller(linen: adapter.Probe, nnx_probe: adapter.Probe, call: str) -> str | None:
  """The call under way when `call` started (Linen's, else NNX's; for a probe that does not
  record callers, the module above it by path); None for an outermost call."""
  for probe in (linen, nnx_probe):
    callers = getattr(probe, 'callers', None)
    if callers:
      return callers.get(call)
  module = _module_of(call)
  return None if module == ROOT else (module.rsplit('/', 1)[0] if '/' in module else ROOT)


def _arguments(recorded: Any) -> dict[str, Any]:
  """A call's recorded arrays by argument name (a lone array: `input`)."""
  if recorded is None:
    return {}
  return dict(recorded) if isinstance(recorded, dict) else {'input': recorded}


def _unnamed(name: str) -> bool:
  """Whether an argument's name is only where it stands: a `*args` element (`*args/1`), or a
  position where no signature names it (`1`)."""
  head = name.split('/', 1)[0]
  return head.startswith('*') or head.isdigit()


def _alike(x: Any, y: Any) -> bool:
  return tuple(x.shape) == tuple(y.shape) and paths.dtype_name(x.dtype) == paths.dtype_name(y.dtype)


def _argument_difference(linen_args: Any, nnx_args: Any, call: str):
  """(name, difference, Linen's, NNX's) of the first argument of `call` that differs, in
  Linen's order; None where every argument found on both sides is bitwise equal.

  Arguments pair by what they are. Named on both sides (their signatures name them), by name.
  Otherwise (a `*args` element, a position no signature names, a name one side alone uses:
  `inputs` in one framework's layer, `x` in the other's) first with an argument of the other
  side it equals bit for bit, as two calls that get the same arrays in another order are the
  same call; what is left then in order, where shapes and dtypes agree, so a real difference
  is named with its argument. One given on one side only (an RNG key one framework takes at
  the call) is not compared.
  """
  a, b = _arguments(linen_args), _arguments(nnx_args)
  by_name = {n: n for n in a if n in b and not _unnamed(n)}
  rest = [n for n in b if n not in by_name.values()]
  pairs = dict(by_name)
  for name, x in a.items():  # the same array elsewhere on the other side
    if name in pairs:
      continue
    same = next((n for n in rest if _alike(x, b[n]) and bitwise.bitwise_equal(x, b[n])), None)
    if same is not None:
      pairs[name] = same
      rest.remove(same)
  for name, x in a.items():  # what is left: the same name, else in order where alike
    if name in pairs:
      continue
    other = name if name in rest else next((n for n in rest if _alike(x, b[n])), None)
    if other is not None:
      pairs[name] = other
      rest.remove(other)
  for name in a:
    if name not in pairs:
      continue
    x, y = a[name], b[pairs[name]]
    diff = bitwise.compare_leaves(f'{call}({name})', x, y)
    if diff is not None:
      return name, diff, x, y
  return None


def _max_ulp(pairs) -> int | None:
  """The largest ULP distance of the differing (Linen, NNX) value pairs.

  None when one of them has none: its dtypes or shapes differ, or it is not floats.
  """
  ulps = [bitwise.ulp_distance(a, b) for a, b in pairs if not bitwise.bitwise_equal(a, b)]
  return None if any(u is None for u in ulps) else max(ulps, default=0)
