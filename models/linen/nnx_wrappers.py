"""The project's own copy of an NNX-in-Linen wrapper, as production codebases carry one.

Large Linen codebases migrating to NNX wrap NNX layers for their Linen
models with a copy of flax's `nnx.bridge.ToLinen` of their own (not flax's
class), often simplified. This is such a copy, used by the production
family's Linen side (models/linen/prod.py): the kit must see through it by
what it does, not by its class. At init it builds the NNX module and keeps
its parameters as Linen `params` under the wrapper's scope, nested as the
module's attributes are (`mlp/wi_0/kernel`), each boxed with its logical
axes. At apply it builds the module afresh, as such wrappers do, from an
`nnx.Rngs` of Linen's own keys (`make_rng` of each RNG collection the apply
has, `dropout` in training, and a `default` stream for its initialisers,
whose values are replaced), puts Linen's parameters in it and calls it: a
dropout inside draws from streams made of Linen's key.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
from flax import nnx
from flax.core import FrozenDict

from parity.core import compat


def _boxed(variable: nnx.Variable) -> Any:
  """A parameter's value, boxed with its logical axes as Linen annotates them."""
  names = compat.nnx_logical_axes(variable)
  value = variable[...]
  return value if names is None else nn.LogicallyPartitioned(value, names)


def _nest(flat: Mapping[tuple, Any]) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(str(key), {})
    node[str(path[-1])] = value
  return out


class ToLinen(nn.Module):
  """An NNX module `nnx_class(*args, **kwargs, rngs=...)` as a Linen module."""

  nnx_class: Callable[..., nnx.Module]
  args: tuple = ()
  kwargs: Mapping[str, Any] = FrozenDict()

  def _build(self, rngs: nnx.Rngs) -> nnx.Module:
    with compat.eager_sharding_off():
      return self.nnx_class(*self.args, **self.kwargs, rngs=rngs)

  @nn.compact
  def __call__(self, *args, **kwargs):
    if self.is_initializing():
      module = self._build(nnx.Rngs(params=self.make_rng('params')))
      flat = {path: _boxed(v) for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
      for name, value in _nest(flat).items():
        self.put_variable('params', name, value)
    module = self._build(nnx.Rngs(**{name: self.make_rng(name) for name in self.scope.rngs}, default=0))
    params = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(params, _plain(nn.meta.unbox(self.variables.get('params', {}))))
    nnx.update(module, params)
    return module(*args, **kwargs)


def _plain(tree: Any) -> Any:
  """Linen's (frozen) variable dicts as plain nested dicts."""
  if isinstance(tree, Mapping):
    return {k: _plain(v) for k, v in tree.items()}
  return tree
