"""The project's own copy of an NNX-in-Linen wrapper, as production codebases carry one.

Large Linen codebases migrating to NNX wrap NNX layers for their Linen
models with a copy of flax's `nnx.bridge.ToLinen` of their own (not flax's
class), often simplified. This is such a copy, used by the production
family's Linen side (models/linen/prod.py): the kit must see through it by
what it does, not by its class. At init it builds the NNX module and keeps
its parameters as Linen `params` under the wrapper's scope, nested as the
module's attributes are (`mlp/wi_0/kernel`), each boxed with its logical
axes; at apply it rebuilds the module from those variables and calls it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
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
    # jax.eval_shape, not nnx.eval_shape: the latter places annotated variables on the active mesh.
    graphdef, abstract = jax.eval_shape(lambda: nnx.split(self._build(nnx.Rngs(0))))
    params = nn.meta.unbox(self.variables.get('params', {}))
    state = jax.tree.map(lambda _, value: value, nnx.to_pure_dict(abstract), _plain(params))
    nnx.replace_by_pure_dict(abstract, state)
    module = nnx.merge(graphdef, abstract)
    return module(*args, **kwargs)


def _plain(tree: Any) -> Any:
  """Linen's (frozen) variable dicts as plain nested dicts."""
  if isinstance(tree, Mapping):
    return {k: _plain(v) for k, v in tree.items()}
  return tree
