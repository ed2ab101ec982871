"""Parameters, optimizer state and step, Linen <-> NNX.

The checkpoint layout is the Linen one: a flat `{path: array}` with
`step`, `params/params/<param path>` and `opt_state/<...>/params/<param path>`
for every optimizer leaf that mirrors a parameter (Adam mu and nu), and with
fp8 `fp8_meta/<path>` for each scale and amax history (the Linen TrainState's
`fp8_meta` field, flax's `_overwrite_with_gradient` collection). On the
NNX side the same leaves live at `0/<param path>` (the model's `nnx.Param`s),
`0/<path>` (its `Fp8Meta` variables) and `1/step`,
`1/opt_state/<...>/<param path>` (the optimizer) of the state of
`(model, optimizer)`.

Every function is pure and strict: a template gives the target structure,
and a missing or extra path or a shape or dtype mismatch raises
TreeMismatchError naming each path. The step counter is the one leaf whose
dtype differs by design (Linen int32, `nnx.Optimizer` uint32); it is
converted exactly and range-checked.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parity.core import paths
from parity.core.errors import Problem, TreeMismatchError
from parity.core.state import LINEN_STEP_DTYPE, NNX_STEP_DTYPE, convert_step, param_suffix  # noqa: F401
from bridge.layout import IDENTITY, Layout
from models.nnx.layers import Fp8Meta

# Checkpoint prefix of the fp8 scaling state (the Linen TrainState field).
FP8_PREFIX = 'fp8_meta/'


def linen_params_to_nnx(linen_variables: Any, nnx_params: Any, layout: Layout = IDENTITY) -> Any:
  """Linen variables `{'params': tree}` -> NNX params state shaped like `nnx_params`."""
  flat = _strip_prefix('Linen variables', paths.flatten(linen_variables), 'params/')
  flat = {p: layout.array_to_nnx(p, x) for p, x in flat.items()}
  return paths.fill('Linen -> NNX parameters', nnx_params, flat)


def nnx_params_to_linen(nnx_params: Any, linen_variables: Any, layout: Layout = IDENTITY) -> Any:
  """NNX params state -> Linen variables `{'params': tree}` shaped like `linen_variables`."""
  flat = {'params/' + p: layout.array_to_linen(p, x) for p, x in paths.flatten(nnx_params).items()}
  return paths.fill('NNX -> Linen parameters', linen_variables, flat)


def linen_to_checkpoint(linen_state: Any) -> dict[str, Any]:
  """The flat checkpoint layout of a Linen TrainState (it is that layout)."""
  flat = paths.flatten(linen_state)
  flat['step'] = convert_step(flat['step'], LINEN_STEP_DTYPE)
  return flat


def nnx_to_checkpoint(nnx_state: Any, layout: Layout = IDENTITY) -> dict[str, Any]:
  """The flat checkpoint layout of the NNX state of `(model, optimizer)`."""
  return _nnx_to_checkpoint_layout(
      paths.flatten(nnx_state),
      _fp8_paths(nnx_state),
      on_param=layout.array_to_linen,
      on_step=lambda x: convert_step(x, LINEN_STEP_DTYPE),
  )


def linen_to_checkpoint_leaves(linen_tree: Any) -> dict[str, Any]:
  """A TrainState-shaped tree of any leaves (e.g. shardings), keyed by checkpoint path."""
  return paths.flatten(linen_tree)


def nnx_to_checkpoint_leaves(nnx_tree: Any, layout: Layout = IDENTITY) -> dict[str, Any]:
  """An NNX-state-shaped tree of NamedShardings, keyed by checkpoint path.

  A layout rule moves a sharding's partition-spec entry with its array axis.
  """
  return _nnx_to_checkpoint_layout(
      paths.flatten(nnx_tree),
      _fp8_paths(nnx_tree),
      on_param=lambda p, sharding: _sharding_to_linen(layout, p, sharding),
      on_step=lambda sharding: sharding,
  )


def _sharding_to_linen(layout: Layout, path: str, sharding: Any) -> Any:
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding  # one device: nothing to move
  spec = tuple(sharding.spec)
  padded = spec + (None,) * (_MAX_RANK - len(spec))
  moved = layout.names_to_linen(path, padded)
  if moved == padded:
    return sharding
  keep = max(len(spec), max((i + 1 for i, e in enumerate(moved) if e is not None), default=0))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*moved[:keep]))


# Longer than any array here; partition specs are padded to it before an axis move.
_MAX_RANK = 8


def _fp8_paths(nnx_tree: Any) -> set[str]:
  """Paths of the `Fp8Meta` variables of an NNX state (or a tree shaped like one)."""
  return {
      p for p, leaf in paths.items(nnx_tree, lambda x: isinstance(x, nnx.Variable))
      if isinstance(leaf, Fp8Meta)
  }


def _nnx_to_checkpoint_layout(
    flat: Mapping[str, Any], fp8_paths: set[str], on_param, on_step
) -> dict[str, Any]:
  """NNX `(model, optimizer)` paths -> checkpoint paths, with per-kind leaf maps.

  Model leaves in `fp8_paths` are fp8 scaling state, the others parameters;
  both move with the layout (the scaling state is stacked like the layers).
  """
  param_paths = _param_paths(flat, '0/') - {p[2:] for p in fp8_paths}
  out: dict[str, Any] = {}
  for path, x in flat.items():
    if path in fp8_paths:
      p = path[2:]
      out[FP8_PREFIX + p] = on_param(p, x)
    elif path.startswith('0/'):
      p = path[2:]
      out['params/params/' + p] = on_param(p, x)
    elif path == '1/step':
      out['step'] = on_step(x)
    elif path.startswith('1/opt_state/'):
      rest = path[len('1/'):]
      p = param_suffix(rest, param_paths)
      if p is None:
        out[rest] = x
      else:
        head = rest[: len(rest) - len(p)]
        out[head + 'params/' + p] = on_param(p, x)
    else:
      raise TreeMismatchError(
          'NNX train state',
          [Problem(path, 'extra', 'model (0/...) or optimizer (1/...) leaf', 'other')],
      )
  return out


def checkpoint_to_linen(flat: Mapping[str, Any], linen_state: Any) -> Any:
  """A Linen TrainState shaped like `linen_state`, filled from the checkpoint layout."""
  flat = dict(flat)
  if 'step' in flat:
    flat['step'] = convert_step(flat['step'], LINEN_STEP_DTYPE)
  template = linen_state.replace(step=jnp.zeros((), LINEN_STEP_DTYPE))
  return paths.fill('checkpoint -> Linen train state', template, flat)


def checkpoint_to_nnx(flat: Mapping[str, Any], nnx_state: Any, layout: Layout = IDENTITY) -> Any:
  """An NNX `(model, optimizer)` state shaped like `nnx_state`, filled from the checkpoint layout."""
  # Parameter paths come from the target, so a parameter missing from the
  # checkpoint is reported once, not again for each of its optimizer leaves.
  param_paths = _param_paths(paths.flatten(nnx_state), '0/')
  out: dict[str, Any] = {}
  for path, x in flat.items():
    if path.startswith('params/params/') or path.startswith(FP8_PREFIX):
      p = path[len('params/params/'):] if path.startswith('params/') else path[len(FP8_PREFIX):]
      out['0/' + p] = layout.array_to_nnx(p, x)
    elif path == 'step':
      out['1/step'] = convert_step(x, NNX_STEP_DTYPE)
    elif path.startswith('opt_state/'):
      p = param_suffix(path, param_paths)
      if p is not None and path[: len(path) - len(p)].endswith('/params/'):
        head = path[: len(path) - len(p) - len('params/')]
        out['1/' + head + p] = layout.array_to_nnx(p, x)
      else:
        out['1/' + path] = x
    else:
      out[path] = x  # reported as an extra path by fill
  return paths.fill('checkpoint -> NNX train state', nnx_state, out)


def linen_to_nnx(linen_state: Any, nnx_state: Any, layout: Layout = IDENTITY) -> Any:
  """Linen TrainState -> NNX `(model, optimizer)` state shaped like `nnx_state`."""
  return checkpoint_to_nnx(linen_to_checkpoint(linen_state), nnx_state, layout)


def nnx_to_linen(nnx_state: Any, linen_state: Any, layout: Layout = IDENTITY) -> Any:
  """NNX `(model, optimizer)` state -> Linen TrainState shaped like `linen_state`."""
  return checkpoint_to_linen(nnx_to_checkpoint(nnx_state, layout), linen_state)


def _strip_prefix(what: str, flat: Mapping[str, Any], prefix: str) -> dict[str, Any]:
  bad = [p for p in flat if not p.startswith(prefix)]
  if bad:
    raise TreeMismatchError(
        what, [Problem(p, 'extra', f'a path under {prefix!r}', 'another collection') for p in bad]
    )
  return {p[len(prefix):]: x for p, x in flat.items()}


def _param_paths(flat: Mapping[str, Any], prefix: str) -> set[str]:
  return {p[len(prefix):] for p in flat if p.startswith(prefix)}
