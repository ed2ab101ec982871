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
its original's tag, and is named as it is.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import jax
from flax import nnx
from flax.nnx import bridge as nnx_bridge


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
# called); static data of the graphdef, so transforms' copies keep it.
PATH_ATTRIBUTE = '_parity_module_path'


def tag_paths(root: nnx.Module, rename: Callable[[str], str], prefix: str = '') -> dict[int, str]:
  """Tags each module of `root`'s graph with its path renamed by `rename` ('' for the root;
  a module reachable by two paths keeps the first), after `prefix` (the path of the module
  that holds `root`, where it is not the model); returns them by `id`."""
  paths: dict[int, str] = {}
  for path, node in nnx.iter_graph(root):
    if isinstance(node, nnx.Module) and id(node) not in paths:
      own = rename('/'.join(str(p) for p in path)) if path else ''
      paths[id(node)] = '/'.join(p for p in (prefix, own) if p)
      if isinstance(node, nnx_bridge.ToNNX):  # it reads every attribute as a Linen variable
        _UNTAGGABLE[node] = paths[id(node)]
      else:
        object.__setattr__(node, PATH_ATTRIBUTE, paths[id(node)])
  return paths


# Modules that cannot hold the tag, by instance (a transform's copy of one is untagged).
_UNTAGGABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tagged_path(module: nnx.Module) -> str | None:
  """The path `tag_paths` gave `module` or the original it was copied from (None: untagged)."""
  path = getattr(module, PATH_ATTRIBUTE, None)
  return _UNTAGGABLE.get(module) if path is None else path


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
