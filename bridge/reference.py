"""The reference decoder as the kit's first client: what `parity` runs when no `--pair` is given.

The installed package holds the kit only; the kit finds this module in the
checkout it runs from (parity/run/reference.py) and imports it from there,
so a project's own `models` or `bridge` package never shadows the kit.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

import jax

from bridge import layout as layout_lib
from bridge import tables
from bridge.flops import train_step_flops
from bridge.sides import abstract_step_inputs, make_sides
from models import config, data
from models.config import ModelConfig, TrainConfig
from bridge import decode as bridge_decode
from parity.compare import activations
from parity.pairs.adapter import Decode, Pair
from parity.core import paths, specs
from parity.core.errors import BadInput
from parity.run.runner import compare_pair
from parity.run.verdicts import CompareResult, SideRun

SCENARIOS = config.SCENARIOS
replace = config.replace


def configs(preset: str, scenario: str):
  """(model config, train config) of a preset and scenario; an unknown name is bad input."""
  try:
    return config.get_configs(preset, scenario)
  except KeyError as e:
    raise BadInput(e.args[0]) from None


def layout_difference(model_cfg) -> str | None:
  """Why memory and program may differ by design: the NNX side stacks layers on another axis."""
  moves = layout_lib.layout_for(model_cfg).moves
  if not moves:
    return None
  return '; '.join(
      f'NNX stacks {m.prefix}* on axis {m.nnx_axis}, Linen on axis {m.linen_axis}' for m in moves
  )


STEPS = 10  # a side-by-side run's default length (`parity compare --steps`)
DECODE_PROMPT, DECODE_STEPS = 16, 32  # `parity compare --decode`: tokens of an eval batch's prompt, tokens decoded


def pair(preset: str = 'tiny', scenario: str = '01_baseline', seed: int = 0) -> Pair:
  """The reference decoder of one preset and scenario, declared as any user's pair.

  `parity compare`, `parity convert` and the battery (tests/test_decoder_pairs.py)
  run the decoder through it: its sides (bridge/sides.py), its batches
  (models/data.py, which depend on the seed), decoding after a 16-token
  prompt, and the report's facts (configs, analytic FLOPs, a layout that
  stacks layers on another axis by design).
  """
  model_cfg, train_cfg = configs(preset, scenario)
  return pair_of(model_cfg, replace(train_cfg, seed=seed), f'decoder_{preset}_{scenario}', (preset, scenario))


def pair_of(model_cfg: ModelConfig, train_cfg: TrainConfig, name: str = 'decoder',
            title: tuple[str, str] | None = None) -> Pair:
  """The reference decoder of any configs as a pair (`pair` names a preset and scenario's)."""
  return Pair(
      name,
      functools.partial(_pair_sides, model_cfg, train_cfg),
      functools.partial(_pair_batch, model_cfg, train_cfg),
      steps=STEPS,
      seed=train_cfg.seed,
      decode=Decode(prompt=lambda batch: batch['inputs'][:, :DECODE_PROMPT], steps=DECODE_STEPS),
      facts=functools.partial(_facts, title, model_cfg, train_cfg),
  )


def _pair_sides(model_cfg, train_cfg, mesh):
  # The decoder's rules and its KV cache's (decoding places the cache by them).
  return make_sides(model_cfg, train_cfg, mesh, specs.DEFAULT_RULES + bridge_decode.CACHE_RULES)


def _pair_batch(model_cfg, train_cfg, step, split='train'):
  return data.make_batch(model_cfg, train_cfg, step=step, split=split)


def _facts(title, model_cfg, train_cfg) -> dict[str, Any]:
  return dict(title=title, model_cfg=model_cfg, train_cfg=train_cfg,
              flops=train_step_flops(model_cfg, train_cfg), layout_difference=layout_difference(model_cfg))


def sides_for(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: jax.sharding.Mesh | None):
  """Both sides of a config, as its pair makes them (`make_sides` keeps them per process, with
  their compilations)."""
  return _pair_sides(model_cfg, train_cfg, mesh)


def run_compare(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    steps: int,
    seed: int = 0,
    init_side: str = 'linen',
    on_step: Callable[[int, SideRun, SideRun], None] | None = None,
    **kwargs,
) -> CompareResult:
  """The reference decoder's two sides of one config compared, through its pair (`compare_pair`)."""
  return compare_pair(pair_of(model_cfg, train_cfg), steps, seed=seed, init_side=init_side, on_step=on_step, **kwargs)


def check_against_config(linen_tree, model_cfg, train_cfg, what: str) -> None:
  """Raises TreeMismatchError unless the Linen-layout tree is the config's train state."""
  linen_side, _ = make_sides(model_cfg, train_cfg)
  paths.check_leaves(what, linen_side.abstract_checkpoint(), linen_tree)


def specs_command(args) -> int:
  """`parity specs`: both sides' parameter (or activation-constraint) tables; exit 1 if they differ."""
  model_cfg, train_cfg = configs(args.preset, args.scenario)
  mesh_sizes = None
  if args.mesh:
    try:
      mesh_sizes = specs.parse_mesh_spec(args.mesh)
    except ValueError as e:
      raise BadInput(str(e)) from None
  linen, nnx_side = make_sides(model_cfg, train_cfg)
  if args.activations:
    batch, key = abstract_step_inputs(model_cfg, train_cfg)
    linen_rows, nnx_rows = (
        activations.rows(side, side.template, batch, key, mesh_sizes=mesh_sizes)
        for side in (linen, nnx_side)
    )
    drift = activations.drift(linen_rows, nnx_rows)
    what, extra = 'activation specs', {}
    heading = 'activation constraints of the train step, in program order (traced, nothing compiled)'
    format_table = activations.format_table
  else:
    linen_rows = tables.linen_rows(linen, mesh_sizes=mesh_sizes)
    nnx_rows = tables.nnx_rows(nnx_side, mesh_sizes=mesh_sizes)
    drift = tables.drift(linen_rows, nnx_rows, nnx_side.layout)
    count = tables.param_count(linen_rows)
    what, extra = 'specs', {'param_count': count}
    heading = f'{count:,} parameters (eval_shape, nothing allocated)'
    format_table = tables.format_table
  if args.format == 'json':
    print(json.dumps({
        'preset': args.preset,
        'scenario': args.scenario,
        'mesh': args.mesh,
        **extra,
        'equal': not drift,
        'differences': drift,
        'linen': linen_rows,
        'nnx': nnx_rows,
    }, indent=1))
  else:
    mesh = f', mesh {args.mesh}' if args.mesh else ''
    print(f'preset {args.preset}, scenario {args.scenario}{mesh}: {heading}')
    for name, rows in (('Linen', linen_rows), ('NNX', nnx_rows)):
      print(f'\n{name}:')
      print(format_table(rows), end='')
    print()
    if drift:
      print(f'{what} differ between Linen and NNX ({len(drift)}):')
      for line in drift:
        print(f'  {line}')
    else:
      print(f'{what} equal on both sides')
  return 1 if drift else 0


def scenarios_command(args) -> int:
  """`parity scenarios`: one line per scenario."""
  del args
  for scenario in SCENARIOS.values():
    print(f'{scenario.name:<20} {scenario.description}')
  return 0
