"""The side-by-side runner: both implementations trained from one state.

One side is initialised, its state is carried to the other through the
bridge's checkpoint layout, then both train on the same batches with the
same dropout base key, their steps interleaved so machine noise hits both
alike. Losses are compared by their bits each step; final parameters and
optimizer state are compared bitwise at the end.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from models import data, rng
from models.config import ModelConfig, TrainConfig
from parity import bitwise
from parity.sides import as_jax_batch, make_sides


@dataclasses.dataclass
class SideRun:
  losses: list[float] = dataclasses.field(default_factory=list)
  loss_hex: list[str] = dataclasses.field(default_factory=list)
  step_times: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompareResult:
  steps: int
  init_side: str
  linen: SideRun
  nnx: SideRun
  first_divergent_step: int | None
  state_diffs: list[str]

  @property
  def bitwise_equal(self) -> bool:
    return self.first_divergent_step is None and not self.state_diffs

  def verdict(self) -> str:
    if self.bitwise_equal:
      return f'bit-identical ({self.steps} steps: losses, final parameters and optimizer state)'
    if self.first_divergent_step is not None:
      return f'DIVERGED at step {self.first_divergent_step}'
    return f'DIVERGED: losses equal but {len(self.state_diffs)} final state leaves differ'

  def to_json(self) -> dict[str, Any]:
    return {
        'bitwise_equal': self.bitwise_equal,
        'first_divergent_step': self.first_divergent_step,
        'steps': self.steps,
        'init_side': self.init_side,
        'state_diffs': self.state_diffs,
        'linen': dataclasses.asdict(self.linen),
        'nnx': dataclasses.asdict(self.nnx),
    }


def loss_hex(x: Any) -> str:
  return float(np.asarray(x, np.float32)).hex()


def run_compare(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    steps: int,
    seed: int = 0,
    init_side: str = 'linen',
    on_step: Callable[[int, float, float], None] | None = None,
) -> CompareResult:
  """Trains both sides `steps` steps from one state; see the module doc."""
  linen, nnx_side = make_sides(model_cfg, train_cfg)
  if init_side == 'linen':
    linen_state = linen.init(seed)
    nnx_state = nnx_side.from_checkpoint(linen.to_checkpoint(linen_state))
  elif init_side == 'nnx':
    nnx_state = nnx_side.init(seed)
    linen_state = linen.from_checkpoint(nnx_side.to_checkpoint(nnx_state))
  else:
    raise ValueError(f"init_side must be 'linen' or 'nnx', got {init_side!r}")

  dropout_base = rng.base_key(seed)
  runs = {'linen': SideRun(), 'nnx': SideRun()}
  states = {'linen': linen_state, 'nnx': nnx_state}
  sides = {'linen': linen, 'nnx': nnx_side}
  first_divergent = None
  for step in range(steps):
    batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, step))
    bits = {}
    for name in ('linen', 'nnx'):
      start = time.perf_counter()
      states[name], metrics = sides[name].train_step(states[name], batch, dropout_base)
      loss = np.asarray(jax.block_until_ready(metrics['loss']))
      runs[name].step_times.append(time.perf_counter() - start)
      runs[name].losses.append(float(loss))
      runs[name].loss_hex.append(loss_hex(loss))
      bits[name] = bitwise.raw_bits(loss)
    if first_divergent is None and not np.array_equal(bits['linen'], bits['nnx']):
      first_divergent = step
    if on_step is not None:
      on_step(step, runs['linen'].losses[-1], runs['nnx'].losses[-1])

  diffs = bitwise.compare_trees(
      linen.to_checkpoint(states['linen']), nnx_side.to_checkpoint(states['nnx'])
  )
  return CompareResult(
      steps=steps,
      init_side=init_side,
      linen=runs['linen'],
      nnx=runs['nnx'],
      first_divergent_step=first_divergent,
      state_diffs=[str(d) for d in diffs],
  )
