"""Layout rules: where the two sides store the same parameter differently.

A rule moves one array axis between the Linen and the NNX layout for every
parameter under a path prefix, and moves the logical axis name on that axis
with it, so specs and arrays never disagree. The identity layout has no rules.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class AxisMove:
  """Parameters under `prefix` keep their axis `linen_axis` at `nnx_axis` on NNX."""

  prefix: str
  linen_axis: int
  nnx_axis: int


@dataclasses.dataclass(frozen=True)
class Layout:
  moves: tuple[AxisMove, ...] = ()

  def _move(self, path: str) -> AxisMove | None:
    for move in self.moves:
      if path.startswith(move.prefix):
        return move
    return None

  def array_to_nnx(self, path: str, x: Any) -> Any:
    move = self._move(path)
    return x if move is None else _move_axis(x, move.linen_axis, move.nnx_axis)

  def array_to_linen(self, path: str, x: Any) -> Any:
    move = self._move(path)
    return x if move is None else _move_axis(x, move.nnx_axis, move.linen_axis)

  def names_to_nnx(self, path: str, names: Sequence[Any]) -> tuple[Any, ...]:
    move = self._move(path)
    return tuple(names) if move is None else _move_item(names, move.linen_axis, move.nnx_axis)

  def names_to_linen(self, path: str, names: Sequence[Any]) -> tuple[Any, ...]:
    move = self._move(path)
    return tuple(names) if move is None else _move_item(names, move.nnx_axis, move.linen_axis)


IDENTITY = Layout()


def layout_for(model_cfg: ModelConfig) -> Layout:
  """The layout implied by a config (stacking axes of the two sides)."""
  if model_cfg.scan_layers and model_cfg.nnx_scan_axis != model_cfg.param_scan_axis:
    return Layout((AxisMove('decoder/layers/', model_cfg.param_scan_axis, model_cfg.nnx_scan_axis),))
  return IDENTITY


def _move_axis(x: Any, src: int, dst: int) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    shape = list(x.shape)
    shape.insert(dst, shape.pop(src))
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  return jnp.moveaxis(x, src, dst)


def _move_item(names: Sequence[Any], src: int, dst: int) -> tuple[Any, ...]:
  names = list(names)
  names.insert(dst, names.pop(src))
  return tuple(names)


def unstack_layers(
    flat: dict[str, Any], num_layers: int, axis: int, stack: str = 'decoder/layers/'
) -> dict[str, Any]:
  """A scanned model's checkpoint leaves as the unscanned model's (Linen layout).

  Every leaf under `stack` (parameters, their optimizer moments, fp8 state)
  is cut along its layer `axis` into `decoder/layers_<i>/...`, one per
  layer; other leaves are kept.
  """
  unscanned = stack.rstrip('/') + '_{}/'
  out: dict[str, Any] = {}
  for path, x in flat.items():
    at = path.find(stack)
    if at < 0 or (at > 0 and path[at - 1] != '/'):
      out[path] = x
      continue
    if x.shape[axis] != num_layers:
      raise ValueError(f'{path}: axis {axis} has {x.shape[axis]} entries, not {num_layers} layers')
    for i in range(num_layers):
      out[path[:at] + unscanned.format(i) + path[at + len(stack):]] = jnp.take(x, i, axis=axis)
  return out
