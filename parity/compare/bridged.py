"""Module calls seen through flax's `nnx.bridge` wrappers, for the kit's interceptors.

A half-migrated model mixes the frameworks: a Linen model with NNX
submodules through `nnx.bridge.ToLinen`, or an NNX model with Linen
submodules through `nnx.bridge.ToNNX`. The localizer and the correspondence
inference record module calls with one framework's hook (Linen's
`nn.intercept_methods`, NNX's patched `__call__`), which stops at the
wrapper. These hooks go on into it: inside a `ToLinen`, the NNX module it
builds reports its submodules' calls; inside a `ToNNX`, the Linen module
does. Each inner call is named by the wrapper's path followed by its own
path inside the wrapped module, which is where both wrappers keep its
variables (`params/<wrapper>/<inner path>/...`), so the names are those of
the checkpoint layout. The wrapped module's own call is the wrapper's: it is
reported once, at the wrapper.

`on_call(path, module, args, run) -> output` is called for each module call
(`run()` makes it), outermost first.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import flax.linen as nn
from flax import nnx
from flax.nnx import bridge as nnx_bridge

from parity.compare import scopes
from parity.core import compat

OnCall = Callable[[str, Any, tuple, Callable[[], Any]], Any]

# The Linen interceptor that records now (None: an NNX module's calls, inside a ToLinen):
# the innermost, so an inner Linen module (inside a ToNNX) is not recorded twice.
_ACTIVE: list[Any] = []


def _join(prefix: str, path: str) -> str:
  return '/'.join(p for p in (prefix, path) if p)


@contextlib.contextmanager
def linen_calls(on_call: OnCall, prefix: str = '') -> Iterator[None]:
  """While active, `on_call` for each Linen module's `__call__`, at `prefix` + its path (the
  root's call skipped under a prefix: its wrapper's reports it), and through each `ToLinen`."""
  token = object()

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if (context.method_name != '__call__' or _ACTIVE[-1] is not token or (prefix and not module.path)
        or compat.in_scan_check_pass()):
      return next_fun(*args, **kwargs)
    path = _join(prefix, '/'.join(module.path))
    run = lambda: next_fun(*args, **kwargs)  # noqa: E731
    if isinstance(module, nnx_bridge.ToLinen) and not module.is_initializing():  # init: not compared
      return on_call(path, module, args, lambda: _into_to_linen(on_call, path, run))
    return on_call(path, module, args, run)

  _ACTIVE.append(token)
  try:
    with nn.intercept_methods(interceptor), compat.scan_check_pass_marked():
      yield
  finally:
    _ACTIVE.pop()


class NnxCalls:
  """The wrapper `scopes.patched_module_calls` puts around each NNX module class's `__call__`:
  `on_call` at the outermost call of each tagged instance (`scopes.tag_paths`), and
  through each `ToNNX`."""

  def __init__(self, on_call: OnCall):
    self.on_call = on_call
    self.active: set[int] = set()

  def __call__(self, original: Callable) -> Callable:
    def __call__(module, *args, **kwargs):
      path = scopes.tagged_path(module)
      if id(module) in self.active or path is None:
        return original(module, *args, **kwargs)
      self.active.add(id(module))
      try:
        run = lambda: original(module, *args, **kwargs)  # noqa: E731
        if isinstance(module, nnx_bridge.ToNNX):
          return self.on_call(path, module, args, lambda: _in_linen(self.on_call, path, run))
        return self.on_call(path, module, args, run)
      finally:
        self.active.discard(id(module))

    return __call__


def _in_linen(on_call: OnCall, path: str, run: Callable[[], Any]) -> Any:
  with linen_calls(on_call, prefix=path):
    return run()


def _into_to_linen(on_call: OnCall, path: str, run: Callable[[], Any]) -> Any:
  """`run()`, a ToLinen's call at `path`, with the calls of the NNX module it builds reported."""

  def hook(module: nnx.Module, method: Callable) -> Callable:
    def called(module, *args, **kwargs):
      scopes.tag_paths(module, lambda p: p, prefix=path)
      calls = NnxCalls(on_call)
      calls.active.add(id(module))  # its own call is the wrapper's
      _ACTIVE.append(None)
      try:
        with scopes.patched_module_calls(module, calls):
          return method(module, *args, **kwargs)
      finally:
        _ACTIVE.pop()

    return called

  with compat.to_linen_module_hook(hook):
    return run()
