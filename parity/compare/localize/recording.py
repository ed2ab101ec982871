"""What the localizer records of a forward pass: each module call's inputs and outputs, by path (`Recorder`)."""
from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax.core import tracers

from parity.compare import bridged
from parity.core import paths


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
