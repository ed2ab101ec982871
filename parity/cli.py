"""`parity`: spec tables and side-by-side runs of the Linen and NNX implementations.

Exit status: 0 equal, 1 the sides differ, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


class BadInput(Exception):
  """A user error: reported in one line, exit status 2."""


def _configs(args):
  from models import config

  try:
    return config.get_configs(args.preset, args.scenario)
  except KeyError as e:
    raise BadInput(e.args[0]) from None


def cmd_specs(args) -> int:
  from bridge import specs
  from parity import tables
  from parity.sides import make_sides

  model_cfg, train_cfg = _configs(args)
  mesh_sizes = None
  if args.mesh:
    try:
      mesh_sizes = specs.parse_mesh_spec(args.mesh)
    except ValueError as e:
      raise BadInput(str(e)) from None
  linen, nnx_side = make_sides(model_cfg, train_cfg)
  linen_rows = tables.linen_rows(linen, mesh_sizes=mesh_sizes)
  nnx_rows = tables.nnx_rows(nnx_side, mesh_sizes=mesh_sizes)
  drift = tables.drift(linen_rows, nnx_rows, nnx_side.layout)
  count = tables.param_count(linen_rows)
  if args.format == 'json':
    print(json.dumps({
        'preset': args.preset,
        'scenario': args.scenario,
        'mesh': args.mesh,
        'param_count': count,
        'equal': not drift,
        'differences': drift,
        'linen': linen_rows,
        'nnx': nnx_rows,
    }, indent=1))
  else:
    mesh = f', mesh {args.mesh}' if args.mesh else ''
    print(f'preset {args.preset}, scenario {args.scenario}{mesh}: {count:,} parameters (eval_shape, nothing allocated)')
    for name, rows in (('Linen', linen_rows), ('NNX', nnx_rows)):
      print(f'\n{name}:')
      print(tables.format_table(rows), end='')
    print()
    if drift:
      print(f'specs differ between Linen and NNX ({len(drift)}):')
      for line in drift:
        print(f'  {line}')
    else:
      print('specs equal on both sides')
  return 1 if drift else 0


def cmd_compare(args) -> int:
  from models import config
  from parity import runner

  model_cfg, train_cfg = _configs(args)
  if args.steps < 1:
    raise BadInput(f'--steps must be at least 1, got {args.steps}')
  train_cfg = config.replace(train_cfg, seed=args.seed)
  print(
      f'parity compare: preset {args.preset}, scenario {args.scenario}, {args.steps} steps,'
      f' seed {args.seed};'
      f' {args.init} initialises, the bridge carries the state to the other side'
  )
  print(f"{'step':>4}  {'Linen loss':<22}{'NNX loss':<22}equal bits")

  def on_step(step, linen_loss, nnx_loss):
    same = runner.loss_hex(linen_loss) == runner.loss_hex(nnx_loss)
    print(f'{step:>4}  {linen_loss:<22.17g}{nnx_loss:<22.17g}{"yes" if same else "NO"}', flush=True)

  result = runner.run_compare(
      model_cfg, train_cfg, args.steps, seed=args.seed, init_side=args.init, on_step=on_step
  )
  for diff in result.state_diffs[:20]:
    print(f'  final state: {diff}')
  print(f'verdict: {result.verdict()}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result.to_json(), f, indent=1)
  return 0 if result.bitwise_equal else 1


def cmd_scenarios(args) -> int:
  from models import config

  del args
  for scenario in config.SCENARIOS.values():
    print(f'{scenario.name:<20} {scenario.description}')
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='parity', description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest='command', required=True)

  specs = sub.add_parser('specs', help='parameter tables of both sides; exit 1 if they differ')
  specs.add_argument('--preset', default='default')
  specs.add_argument('--scenario', default='01_baseline', help='see `parity scenarios`')
  specs.add_argument('--mesh', default=None, help='e.g. fsdp=8 or data=2,fsdp=2,tensor=2')
  specs.add_argument('--format', choices=('table', 'json'), default='table')
  specs.set_defaults(func=cmd_specs)

  compare = sub.add_parser('compare', help='train both sides side by side; exit 1 on divergence')
  compare.add_argument('--preset', default='tiny')
  compare.add_argument('--scenario', default='01_baseline', help='see `parity scenarios`')
  compare.add_argument('--steps', type=int, default=10)
  compare.add_argument('--seed', type=int, default=0)
  compare.add_argument('--init', choices=('linen', 'nnx'), default='linen',
                       help='which side initialises (the other receives the state)')
  compare.add_argument('--json', default=None, metavar='FILE')
  compare.set_defaults(func=cmd_compare)

  scenarios = sub.add_parser('scenarios', help='list the scenarios')
  scenarios.set_defaults(func=cmd_scenarios)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except BadInput as e:
    print(f'parity: error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
