"""Module calls recorded on either side, and through wrappers between the frameworks by what they do.

The localizer and the correspondence inference record module calls with one
framework's hook: Linen's `nn.intercept_methods`; NNX, every module class's
`__call__` and public methods patched while recording
(`scopes.patched_module_methods`), each instance named by its tag
(`scopes.tag_paths`). Both hooks are on in every recording, so a
half-migrated model is seen through its wrappers, whatever their class
(flax's `nnx.bridge.ToLinen` and `ToNNX`, a project's own copy of either):

- a wrapper into NNX is a Linen module whose call runs an NNX module: the
  first NNX module called inside a recorded Linen call, untagged, is that
  call's wrapped module. Its graph is tagged under the wrapper's path;
- a wrapper into Linen is an NNX module whose call applies a Linen module:
  a Linen module called inside a recorded NNX call is named under it, its
  root (scope path `()`) being the wrapped module.

The wrapped module's own call is the wrapper's: it is reported once, at the
wrapper. The calls inside are named by the wrapper's path, then where the
wrapper keeps the inner module's variables, then the inner module's own
path: `params/<wrapper>/<inner path>/...` (flax's wrappers and MaxText's
copies keep them so), so the names are those of the checkpoint layout. Where
is read off the variables both hold, the same arrays (`_between`); where
none are shared (a wrapper that copies them), the inner path follows the
wrapper's directly.

Each module call reports its method (`__call__`, or a public method a
module calls on another, such as `Embed.attend`: not `setup`, not a private
helper, not a method a module calls on itself, not one called from outside
every module) and every argument it was given
(`Arguments`). `on_call(path, module, arguments, run) -> output` is called
for each call (`run()` makes it), outermost first.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
from flax import nnx

from parity.compare import scopes
from parity.core import compat, paths


@dataclasses.dataclass
class Arguments:
  """What one module call was given: its method, its arguments, and the method's function
  (whose signature names them)."""

  method: str
  args: tuple
  kwargs: dict
  function: Callable | None = None
  wrapped: type | None = None  # set on a wrapper's call: the class of the module it runs

  def named(self) -> dict[str, Any]:
    """Each array the call was given, by its parameter's name in the method's signature
    (`mask`, `x/0` inside a tuple, `*args/2` for a `*args` one, `2` where no signature names
    it), in the signature's order."""
    out = {}
    for name, value in self._bound():
      for sub, leaf in paths.items(value, is_leaf=_opaque):
        if isinstance(leaf, jax.Array):
          out[f'{name}/{sub}' if sub else name] = leaf
    return out

  def _bound(self) -> list[tuple[str, Any]]:
    signature = _signature(self.function)
    if signature is not None:
      try:
        bound = signature.bind(None, *self.args, **self.kwargs)  # None: the module's own slot
      except TypeError:
        bound = None
      if bound is not None:
        out = []
        for name, value in list(bound.arguments.items())[1:]:
          kind = signature.parameters[name].kind
          if kind is inspect.Parameter.VAR_KEYWORD:
            out += list(value.items())
          elif kind is inspect.Parameter.VAR_POSITIONAL:  # unnamed: `*args/0`, matched by what it is
            out += [(f'*{name}/{i}', v) for i, v in enumerate(value)]
          else:
            out.append((name, value))
        return out
    return [(str(i), a) for i, a in enumerate(self.args)] + list(self.kwargs.items())


@functools.lru_cache(maxsize=None)
def _signature(function: Callable | None) -> inspect.Signature | None:
  try:
    return None if function is None else inspect.signature(function)
  except (TypeError, ValueError):
    return None


def _opaque(x: Any) -> bool:
  """A module or variable among the arguments: not looked into (its state is not an argument)."""
  return isinstance(x, (nnx.Pytree, nnx.Variable, nn.Module))


OnCall = Callable[[str, Any, Arguments, Callable[[], Any]], Any]


def recordable(method: str, session: '_Session') -> bool:
  """Whether a call of `method` is a module call: `__call__`, or a public method a module
  calls (not one called from outside every module, as a decode loop calls `init_cache`)."""
  if method == '__call__':
    return True
  return not (method.startswith('_') or method == 'setup') and bool(session.frames)


def _join(*parts: str) -> str:
  return '/'.join(p for p in parts if p)


def _under(path: str | None, prefix: str) -> bool:
  return path is not None and (not prefix or path == prefix or path.startswith(prefix + '/'))


@dataclasses.dataclass
class _Frame:
  """A module call under way: recorded, or a wrapped module's own (its wrapper's) call."""

  framework: str  # 'linen' or 'nnx': the module's
  path: str
  module: Any
  method: str
  # Linen: the recorded path of a module of its context by its scope path (inside a wrapper,
  # where the scope root is the wrapped module, the wrapper's path comes first).
  name: Callable[[str], str] = lambda path: path
  inner: bool = False  # Linen: inside a wrapper
  wraps: bool = False  # a Linen call that may run a wrapped NNX module (recorded, not initializing)
  arguments: Arguments | None = None
  linen_name: Callable[[str], str] | None = None  # NNX: `name` of a Linen module it applies, once found


class _Session:
  """One recording: `on_call` for each module call, the calls under way."""

  def __init__(self, on_call: OnCall, framework: str, rename: Callable[[str], str] = lambda path: path):
    self.on_call = on_call
    self.framework = framework  # the model's: its outermost module calls are recorded
    self.rename = rename  # NNX: a path inside a wrapper into Linen, as the model's are renamed
    self.frames: list[_Frame] = []
    self.nnx_active: set[int] = set()  # NNX modules with a call under way (their own calls to themselves)
    self.wrapped: set[int] = set()  # NNX modules a wrapper runs: their calls are the wrapper's

  def run_in(self, frame: _Frame, run: Callable[[], Any]) -> Any:
    self.frames.append(frame)
    own = frame.framework == 'nnx' and id(frame.module) not in self.nnx_active
    if own:
      self.nnx_active.add(id(frame.module))
    try:
      return run()
    finally:
      if own:
        self.nnx_active.discard(id(frame.module))
      self.frames.pop()


_SESSIONS: list[_Session] = []


@contextlib.contextmanager
def _session(on_call: OnCall, framework: str, rename: Callable[[str], str] = lambda path: path) -> Iterator[None]:
  """Both frameworks' hooks, on for the outermost recording, dispatching to the innermost."""
  outermost = not _SESSIONS
  _SESSIONS.append(_Session(on_call, framework, rename))
  try:
    if not outermost:
      yield
      return
    with nn.intercept_methods(_linen_intercept), compat.scan_check_pass_marked(), \
        scopes.patched_module_methods(_nnx_method):
      yield
  finally:
    _SESSIONS.pop()


@contextlib.contextmanager
def linen_calls(on_call: OnCall) -> Iterator[None]:
  """While active, `on_call` for each Linen module call (at its scope path) and each call
  inside a wrapper (at the wrapper's path followed by the inner module's)."""
  with _session(on_call, 'linen'):
    yield


@contextlib.contextmanager
def nnx_calls(on_call: OnCall, rename: Callable[[str], str] = lambda path: path) -> Iterator[None]:
  """While active, `on_call` for each call of an NNX module tagged with its path
  (`scopes.tag_paths` with `rename`, by the caller), outermost per instance, and each call
  inside a wrapper (at the wrapper's path followed by the inner module's, renamed alike)."""
  with _session(on_call, 'nnx', rename):
    yield


def _linen_intercept(next_fun, args, kwargs, context):
  session = _SESSIONS[-1] if _SESSIONS else None
  module, method = context.module, context.method_name
  run = lambda: next_fun(*args, **kwargs)  # noqa: E731
  if session is None or compat.in_scan_check_pass() or not recordable(method, session) or not (
      method == '__call__' or inspect.isfunction(inspect.getattr_static(type(module), method, None))):
    return run()  # not a module call: Linen's own plumbing, a private helper, a property

  frame = session.frames[-1] if session.frames else None
  if frame is not None and frame.framework == 'linen':
    name, inner = frame.name, frame.inner
  elif frame is not None:  # an NNX module's call applies a Linen module: a wrapper into Linen
    if frame.linen_name is None:
      frame.linen_name = _inside(session, frame, module)
    name, inner = frame.linen_name, True
  elif session.framework == 'linen':
    name, inner = (lambda path: path), False
  else:
    return run()
  path = name('/'.join(module.path))
  recording = not module.is_initializing()
  if inner and not module.path:  # the wrapped module's own call: its wrapper's
    return session.run_in(_Frame('linen', path, module, method, name, inner), run)
  if any(f.framework == 'linen' and f.path == path and f.method != method for f in session.frames):
    return run()  # a module calling a method of its own
  arguments = Arguments(method, tuple(args), dict(kwargs), getattr(type(module), method, None))
  frame = _Frame('linen', path, module, method, name, inner, wraps=recording, arguments=arguments)
  return session.on_call(path, module, arguments, lambda: session.run_in(frame, run))


def _nnx_method(original: Callable, name: str) -> Callable:
  """`original` (a method of an NNX module class) reporting its calls to the recording."""

  @functools.wraps(original)
  def method(module, *args, **kwargs):
    session = _SESSIONS[-1] if _SESSIONS else None
    run = lambda: original(module, *args, **kwargs)  # noqa: E731
    if (session is None or id(module) in session.nnx_active or compat.in_scan_check_pass()
        or not recordable(name, session)):
      return run()
    frame = session.frames[-1] if session.frames else None
    path = scopes.tagged_path(module)
    if frame is not None and frame.framework == 'linen' and frame.wraps and not _under(path, frame.path):
      # A Linen module's call runs an NNX module: a wrapper into NNX; its module is named
      # under the wrapper's path, where the wrapper keeps its variables.
      scopes.tag_paths(module, lambda p: p, prefix=_join(frame.path, _nnx_within(frame.module, module)))
      session.wrapped.add(id(module))
      if frame.arguments is not None:
        frame.arguments.wrapped = type(module)
      path = scopes.tagged_path(module)
    if path is None:
      return run()
    if id(module) in session.wrapped:  # the wrapped module's own call: its wrapper's
      return session.run_in(_Frame('nnx', path, module, name), run)
    arguments = Arguments(name, args, kwargs, original)
    frame = _Frame('nnx', path, module, name, arguments=arguments)
    return session.on_call(path, module, arguments, lambda: session.run_in(frame, run))

  return method


# -- where a wrapper keeps the inner module's variables ----------------------------------


def _linen_variables(module: nn.Module) -> dict[str, Any]:
  """A bound Linen module's variables by their path below it, collections merged."""
  out = {}
  for path, leaf in paths.flatten(module.variables).items():
    out.setdefault(path.partition('/')[2], leaf)
  return out


def _nnx_variables(module: nnx.Module) -> dict[str, Any]:
  return paths.flatten(nnx.state(module))


def _nnx_within(wrapper: nn.Module, module: nnx.Module) -> str:
  """The path in a Linen wrapper's variables where it keeps `module`'s ('' where the
  wrapper keeps them as the module's own paths, or shares none of them)."""
  try:
    return _between(_linen_variables(wrapper), _nnx_variables(module))
  except Exception:  # pylint: disable=broad-except  (the graph's paths stand for it)
    return ''


def _inside(session: _Session, frame: _Frame, module: nn.Module) -> Callable[[str], str]:
  """How the Linen modules an NNX wrapper (`frame`'s) applies are named: by the wrapper's own
  path, where it keeps their variables and their scope path, renamed as the model's paths
  are (its tag's path where it has no path of its own)."""
  own = scopes.tagged_path(frame.module, renamed=False)
  within = _linen_within(frame.module, module)
  if own is None:
    return lambda path: _join(frame.path, within, path)
  return lambda path: session.rename(_join(own, within, path))


def _linen_within(wrapper: nnx.Module, module: nn.Module) -> str:
  """The path in an NNX wrapper's state where it keeps the variables of the Linen module
  it applies (`module`, at its scope path inside it)."""
  try:
    found = _between(_nnx_variables(wrapper), _linen_variables(module))
  except Exception:  # pylint: disable=broad-except
    return ''
  own = '/'.join(module.path)
  if own and (found == own or found.endswith('/' + own)):
    return found[:-len(own)].rstrip('/')
  return '' if own else found


def _between(outer: dict[str, Any], inner: dict[str, Any]) -> str:
  """The path `q` by which `outer` holds the arrays of `inner` (`outer[q/p] is inner[p]`),
  the most common one; '' where they share none."""
  where = {id(leaf): path for path, leaf in outer.items()}
  found: collections.Counter = collections.Counter()
  for path, leaf in inner.items():
    held = where.get(id(leaf))
    if held is not None and (held == path or held.endswith('/' + path)):
      found[held[:len(held) - len(path)].rstrip('/')] += 1
  return found.most_common(1)[0][0] if found else ''
