"""NNX module calls named as Linen names its modules, in the lowered program.

Linen pushes each module's path onto jax's name stack, so every operation of
a lowered Linen program carries the module it belongs to in its debug
location (`jvp(Encoder)/layers_0/LayerNorm_0/mul`). NNX modules push
nothing. `nnx_module_scopes` wraps each module class's `__call__` (restored
on exit) in a `jax.named_scope` of the module's Linen path relative to its
caller's, the root named by its class as Linen does, so that the same
operation reads `jvp(Encoder)/layers_0/LayerNorm_0/mul` on both sides.

Names change debug locations only: the program, and jax's compilation cache
key (which strips debug information), stay the same. parity.compare.programs reads
them to confine a declared program difference to its modules.

Modules called inside an NNX transform's body (`nnx.remat`, `nnx.scan`,
`nnx.vmap`) are copies the transform makes with `nnx.merge`, not the
instances found in the model. So the outermost call tags every module of
its graph with its path (`tag_paths`, an attribute NNX keeps in the
graphdef as static data, as it keeps a layer's `features`): a copy carries
its original's tag, and is named as it is. The attribute's name starts as
NNX's own bookkeeping does (`_pytree__`), which a module that hands its
attributes to a Linen module as variables (flax's `nnx.bridge.ToNNX`, a
project's copy of it) leaves out as it leaves out NNX's own.

`patched_module_methods` patches every NNX module class there is, `__call__`
and public methods: what the kit's call recorders use
(parity/compare/bridged.py), since a wrapper may build a module of any class.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import jax
from flax import nnx


def call_owner(module: nnx.Module) -> type | None:
  """The class in `module`'s MRO that defines `__call__` (None: not callable, e.g. a container)."""
  return next((c for c in type(module).__mro__ if '__call__' in c.__dict__), None)


@contextlib.contextmanager
def patched_module_calls(sample: nnx.Module, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
  """Each module class found in `sample` with its `__call__` replaced by `wrap(original)`.

  The class that defines `__call__` is patched (restored on exit), so every
  instance traced meanwhile, including those `nnx.merge` creates, is wrapped.
  """
  classes = {}
  for _, node in nnx.iter_graph(sample):
    if isinstance(node, nnx.Module):
      owner = call_owner(node)
      if owner is not None:  # not callable: containers, rng holders
        classes[owner] = owner.__dict__['__call__']
  try:
    for owner, original in classes.items():
      setattr(owner, '__call__', wrap(original))
    yield
  finally:
    for owner, original in classes.items():
      setattr(owner, '__call__', original)


# The attribute holding a module's path (relative to the outermost module
# called); static data of the graphdef, so transforms' copies keep it. Named as
# NNX's own state (`_pytree__state`), which wrappers handing a module's attributes
# to Linen as variables leave out (flax's ToNNX, MaxText's copy of it).
PATH_ATTRIBUTE = '_pytree__parity_path'
# Its path as it is (`rename` not applied): what a Linen module it applies is named under.
OWN_PATH_ATTRIBUTE = '_pytree__parity_own_path'


def tag_paths(root: nnx.Module, rename: Callable[[str], str], prefix: str = '') -> dict[int, str]:
  """Tags each module of `root`'s graph with its path renamed by `rename` ('' for the root;
  a module reachable by two paths keeps the first), after `prefix` (the path of the module
  that holds `root`, where it is not the model); returns them by `id`."""
  paths: dict[int, str] = {}
  for path, node in nnx.iter_graph(root):
    if isinstance(node, nnx.Module) and id(node) not in paths:
      own = '/'.join(str(p) for p in path)
      paths[id(node)] = '/'.join(p for p in (prefix, rename(own) if own else '') if p)
      object.__setattr__(node, PATH_ATTRIBUTE, paths[id(node)])
      object.__setattr__(node, OWN_PATH_ATTRIBUTE, '/'.join(p for p in (prefix, own) if p))
  return paths


def tagged_path(module: nnx.Module, renamed: bool = True) -> str | None:
  """The path `tag_paths` gave `module` or the original it was copied from, renamed or as it
  is (None: untagged)."""
  if not hasattr(module, '__dict__'):
    return None
  return vars(module).get(PATH_ATTRIBUTE if renamed else OWN_PATH_ATTRIBUTE)


def module_classes() -> list[type]:
  """Every NNX module class defined so far (subclasses of `nnx.Module`, at any depth)."""
  seen, stack = [], [nnx.Module]
  while stack:
    for sub in type.__subclasses__(stack.pop()):
      if sub not in seen:
        seen.append(sub)
        stack.append(sub)
  return seen


# nnx.Module's own API (`sow`, `train`, ...): not a layer's computation.
_MODULE_API = frozenset(name for name in dir(nnx.Module) if not name.startswith('_'))


def _recorded_methods(cls: type) -> list[str]:
  """The methods of `cls` (its own, not inherited) a call recorder wraps: `__call__` and
  public functions, but not NNX's own API; of flax's bridge and container classes
  (`bridge.Module.param`, `List.append`), `__call__` only."""
  own = cls.__dict__
  names = ['__call__'] if callable(own.get('__call__')) and not isinstance(
      own.get('__call__'), (staticmethod, classmethod)) else []
  if cls.__module__.startswith(('flax.nnx.bridge', 'flax.nnx.helpers')):
    return names
  return names + [name for name, value in own.items()
                  if not name.startswith('_') and name not in _MODULE_API and inspect.isfunction(value)]


@contextlib.contextmanager
def patched_module_methods(wrap: Callable[[Callable, str], Callable]) -> Iterator[None]:
  """Every NNX module class's `__call__` and public methods replaced by `wrap(original, name)`
  (restored on exit): instances traced meanwhile, of any class (one a wrapper builds, one
  `nnx.merge` creates), are wrapped."""
  patched = []
  try:
    for cls in module_classes():
      for name in _recorded_methods(cls):
        original = cls.__dict__[name]
        setattr(cls, name, wrap(original, name))
        patched.append((cls, name, original))
    yield
  finally:
    for cls, name, original in reversed(patched):
      setattr(cls, name, original)


@contextlib.contextmanager
def nnx_module_scopes(sample: nnx.Module, rename: Callable[[str], str]) -> Iterator[None]:
  """While active, a call of any module class found in `sample` runs in its Linen path's scope.

  Paths are read from the outermost module called (`nnx.iter_graph`), NNX
  path `layers/0/norm1` renamed by `rename` (e.g. to `layers_0/LayerNorm_0`);
  a transform's copy is named by its original's tag (`tag_paths`).
  """
  active: list[str] = []

  def wrap(original):
    def __call__(self, *args, **kwargs):
      if not active:
        tag_paths(self, rename)
      path = tagged_path(self)
      if path is None or (active and path == active[-1]):  # unknown, or a call from its own body
        return original(self, *args, **kwargs)
      parent = active[-1] if active else None
      if parent is None:
        name = type(self).__name__
      elif parent and path.startswith(parent + '/'):
        name = path[len(parent) + 1:]
      else:
        name = path
      active.append(path)
      try:
        with jax.named_scope(name):
          return original(self, *args, **kwargs)
      finally:
        active.pop()

    return __call__

  with patched_module_calls(sample, wrap):
    yield
