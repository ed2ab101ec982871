"""Runs shared by test modules: each is computed once per process (and cached).

`tiny_run` is the side-by-side runner's 10-step comparison on one device.
`mesh_run` trains both sides on a mesh of the 8 CPU devices (or any mesh)
from one state, as `parity compare --mesh` does (the batch placed, the
compiled steps run), keeping everything the mesh tests look at: per-step train metrics,
the final state in the checkpoint layout, each state leaf's actual sharding,
the sharding annotations of both lowered train steps, their memory analysis
and their canonical program diff.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import jax

from parity.core import specs
from bridge import train_state as bridge_state
from models import data, rng
from models.config import SCENARIOS, ModelConfig, TrainConfig, get_configs
from parity.procs import distributed
from parity.compare import programs
from parity.run import compiling
from parity.compare.programs import sharding_annotations
from bridge.reference import run_compare
from parity.run.verdicts import CompareResult
from bridge.sides import RULES, make_sides

STEPS = 10
MESH_STEPS = 3

# The mesh matrix. `--full-mesh-matrix`: every scenario on every mesh (52
# pairs, each about 13 s of compile when nothing is cached, up to twice that for
# the composites). By default (14 pairs): the baseline on all four meshes, every
# scenario on the 3-axis mesh except three whose sharded programs other default
# pairs already cover, and gradient accumulation (with dropout) on the seed logs'
# fsdp=8 too, where tests/test_checkpoints.py trains it. The core tier
# (tests/tiers.py, `make test`) keeps 11_composite_accum on the 3-axis mesh; the
# rest are the exhaustive tier's.
MESHES = ('fsdp=8', 'fsdp=4,tensor=2', 'data=2,fsdp=4', 'data=2,fsdp=2,tensor=2')
THREE_AXES = 'data=2,fsdp=2,tensor=2'
EXTRA_MESHES = {'01_baseline': MESHES, '06_grad_accum': ('fsdp=8', THREE_AXES)}
FULL_MATRIX_ONLY = {
    '03_dropout': 'dropout on a mesh: 06_grad_accum trains with dropout 0.1 on two meshes',
    '04_remat_save_dots': 'rematerialisation on a mesh: 04_remat',
    '12_composite_fp8': 'fp8, unrolled layers and full remat on a mesh: 05_fp8, 02_unscanned and 04_remat',
}


def mesh_cases(full: bool, meshes: tuple[str, ...] = MESHES) -> list[tuple[str, str]]:
  """(scenario, mesh) pairs the suite trains on a mesh, among `meshes`."""
  cases = []
  for scenario in sorted(SCENARIOS):
    if full:
      chosen = MESHES
    elif scenario in FULL_MATRIX_ONLY:
      chosen = ()
    else:
      chosen = EXTRA_MESHES.get(scenario, (THREE_AXES,))
    cases += [(scenario, mesh) for mesh in chosen if mesh in meshes]
  return cases


@functools.cache
def tiny_run(scenario: str = '01_baseline', init_side: str = 'linen') -> CompareResult:
  return run_compare(*get_configs('tiny', scenario), steps=STEPS, init_side=init_side)


@functools.cache
def start(scenario: str = '01_baseline'):
  """Both sides of `scenario` on the tiny preset, one device, and their common start.

  Returns ((linen side, nnx side), (linen state, nnx state)): Linen
  initialises with seed 0 and the bridge carries its state to NNX.
  """
  linen, nnx_side = make_sides(*get_configs('tiny', scenario))
  linen_state = linen.init(0)
  return (linen, nnx_side), (linen_state, nnx_side.from_checkpoint(linen.to_checkpoint(linen_state)))


@dataclasses.dataclass
class SideOnMesh:
  metrics: list[dict[str, jax.Array]]  # each step's train metrics (loss, z-loss, tokens)
  final: dict[str, jax.Array]  # checkpoint layout
  init_shardings: dict[str, jax.sharding.Sharding]  # actual, at the start; checkpoint layout
  shardings: dict[str, jax.sharding.Sharding]  # actual, after training; checkpoint layout
  targets: dict[str, jax.sharding.Sharding]  # what the side asked for
  annotations: collections.Counter  # `signature ...` keys: arguments and results

  @property
  def losses(self) -> list[jax.Array]:
    return [m['loss'] for m in self.metrics]


@dataclasses.dataclass
class MeshRun:
  linen: SideOnMesh
  nnx: SideOnMesh
  memory: tuple[dict, dict]  # XLA's memory analysis of each side's train step
  program_diff: programs.ProgramDiff
  main_signatures: tuple[str, str]  # the `@main` line of each side's lowered train step
  batch_shardings: tuple[dict, dict]  # each compiled step's batch input shardings, per batch key
  side_batch_sharding: jax.sharding.Sharding | None  # where the Linen side places a batch (None: one device)


def train_on_mesh(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    mesh: jax.sharding.Mesh | None,
    rules: specs.Rules = RULES,
    steps: int = MESH_STEPS,
) -> MeshRun:
  """Linen initialises; NNX starts from the same state; both train `steps` steps."""
  linen, nnx_side = make_sides(model_cfg, train_cfg, mesh, rules)
  linen_state = linen.init(0)
  nnx_state = nnx_side.from_checkpoint(linen.to_checkpoint(linen_state))
  of_leaf = lambda x: x.sharding
  # NNX starts from Linen's state here; tests/test_sharding.py checks NNX's
  # own init separately (once), which saves a compile per run.
  init_shardings = (
      bridge_state.linen_to_checkpoint_leaves(jax.tree.map(of_leaf, linen_state)),
      bridge_state.nnx_to_checkpoint_leaves(jax.tree.map(of_leaf, nnx_state), nnx_side.layout),
  )
  base = rng.base_key(0)
  if mesh is not None:  # as `parity compare` places it (one array over the mesh, as restored)
    base = distributed.replicated(base, mesh)
  # The batches placed, the steps compiled and run as `parity compare` does
  # (parity/run/runner.py): what these tests check is the program it runs.
  batches = [linen.place_batch(data.make_batch(model_cfg, train_cfg, s)) for s in range(steps)]
  compiled = [
      compiling.compile_step(side, state, batches[0], base)
      for side, state in ((linen, linen_state), (nnx_side, nnx_state))
  ]
  annotations = tuple(sharding_annotations(c.text, True) for c in compiled)
  device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
  metrics = ([], [])
  for batch in batches:
    linen_state, linen_metrics = compiled[0].executable(linen_state, batch, base)
    nnx_state, nnx_metrics = compiled[1].executable(nnx_state, batch, base)
    metrics[0].append(dict(linen_metrics))
    metrics[1].append(dict(nnx_metrics))
  return MeshRun(
      linen=SideOnMesh(
          metrics[0],
          linen.to_checkpoint(linen_state),
          init_shardings[0],
          bridge_state.linen_to_checkpoint_leaves(jax.tree.map(of_leaf, linen_state)),
          linen.checkpoint_shardings() if mesh is not None else {},
          annotations[0],
      ),
      nnx=SideOnMesh(
          metrics[1],
          nnx_side.to_checkpoint(nnx_state),
          init_shardings[1],
          bridge_state.nnx_to_checkpoint_leaves(jax.tree.map(of_leaf, nnx_state), nnx_side.layout),
          nnx_side.checkpoint_shardings() if mesh is not None else {},
          annotations[1],
      ),
      memory=(compiled[0].memory(device), compiled[1].memory(device)),
      program_diff=compiling.program_diff_of(*compiled),
      batch_shardings=(compiled[0].batch_sharding, compiled[1].batch_sharding),
      side_batch_sharding=None if mesh is None else linen.batch_sharding,
      main_signatures=tuple(
          next(line for line in c.text.splitlines() if 'func.func public @main(' in line) for c in compiled
      ),
  )


@functools.cache
def mesh_run(scenario: str, mesh_spec: str | None) -> MeshRun:
  """`scenario` on the tiny preset, on `mesh_spec` ('fsdp=8', ...) or one device (None)."""
  mesh = None if mesh_spec is None else specs.make_mesh(mesh_spec)
  return train_on_mesh(*get_configs('tiny', scenario), mesh)
