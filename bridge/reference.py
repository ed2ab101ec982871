"""The reference decoder as the kit's first client: what `parity` runs when no `--pair` is given.

The installed package holds the kit only; the kit finds this module in the
checkout it runs from (parity/run/reference.py) and imports it from there,
so a project's own `models` or `bridge` package never shadows the kit.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import jax

from bridge import layout as layout_lib
from bridge import tables
from bridge.flops import train_step_flops
from bridge.sides import abstract_step_inputs, make_sides
from models import config, data
from models.config import ModelConfig, TrainConfig
from parity.compare import activations
from parity.core import paths, specs
from parity.core.errors import BadInput
from parity.run.runner import CompareResult, SideRun, compare_sides

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


def sides_for(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: jax.sharding.Mesh | None):
  """Both sides of a config (`make_sides` keeps them per process, with their compilations)."""
  return make_sides(model_cfg, train_cfg, mesh)


def run_compare(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    steps: int,
    seed: int = 0,
    init_side: str = 'linen',
    on_step: Callable[[int, SideRun, SideRun], None] | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    **kwargs,
) -> CompareResult:
  """The reference decoder's two sides of one config, compared (see `compare_sides`)."""
  result = compare_sides(
      sides_for(model_cfg, train_cfg, mesh),
      lambda step: data.make_batch(model_cfg, train_cfg, step),
      steps, seed, init_side, on_step, mesh=mesh, **kwargs,
  )
  result.model_cfg, result.train_cfg = model_cfg, train_cfg
  result.flops = train_step_flops(model_cfg, train_cfg)
  result.layout_difference = layout_difference(model_cfg)
  return result



DECODE_PROMPT = 16  # tokens of an eval batch's inputs that `parity compare --decode` decodes after


def decode_prompt(model_cfg, train_cfg):
  """The prompt `parity compare --decode N` decodes after: the first tokens of an eval batch."""
  return data.make_batch(model_cfg, train_cfg, 0, 'eval')['inputs'][:, :DECODE_PROMPT]


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
