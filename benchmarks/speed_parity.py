"""Speed parity of the two sides: the NNX/Linen step-time ratio, with its spread.

Not a timed test: a benchmark to run by hand (or in CI on a quiet machine).
Both train steps are compiled once; then `--repetitions` independent runs
(`bridge.reference.run_compare`: a fresh state each, the sides' steps
interleaved, which side goes first alternating every step, each step timed
from dispatch to its loss on the host) of `--steps` steps each. Step 0 of a
run is left out (first-execution effects). Per run, the ratio of median step
times; over all runs, the median ratio and its spread, and the spread of the
ratios of the paired steps (the two sides' same step, back to back).

The `small` preset takes well over 50 ms a step on a CPU, so timer and
dispatch overhead do not dominate. Run from the repository root:

  python benchmarks/speed_parity.py [--preset small] [--repetitions 5] [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.config import get_configs  # noqa: E402
from bridge import reference  # noqa: E402
from parity.run import runner  # noqa: E402


def _quantile(xs: list[float], q: float) -> float:
  xs = sorted(xs)
  pos = q * (len(xs) - 1)
  lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
  return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--preset', default='small')
  parser.add_argument('--scenario', default='01_baseline')
  parser.add_argument('--repetitions', type=int, default=5)
  parser.add_argument('--steps', type=int, default=6, help='per repetition, step 0 included')
  parser.add_argument('--json', default=None, metavar='FILE')
  args = parser.parse_args(argv)
  if args.repetitions < 1 or args.steps < 2:
    parser.error('need --repetitions >= 1 and --steps >= 2')

  model_cfg, train_cfg = get_configs(args.preset, args.scenario)
  load_before = os.getloadavg()
  print(
      f'speed parity: preset {args.preset}, scenario {args.scenario}, one device;'
      f' {args.repetitions} repetitions x {args.steps} steps (step 0 left out),'
      f' sides interleaved, order alternating',
      flush=True,
  )
  start = time.perf_counter()
  rows, pair_ratios = [], []
  for rep in range(args.repetitions):
    result = reference.run_compare(model_cfg, train_cfg, args.steps, program_diff=False)
    if not result.bitwise_equal:
      print(f'repetition {rep}: the sides diverged ({result.verdict()})', file=sys.stderr)
      return 1
    linen, nnx = result.linen.step_times[1:], result.nnx.step_times[1:]
    pair_ratios += [n / l for l, n in zip(linen, nnx)]
    rows.append((statistics.median(linen), statistics.median(nnx)))
    if rep == 0:
      print(f'compile s: Linen {result.linen.compile_s:.2f}, NNX {result.nnx.compile_s:.2f}'
            ' (first repetition; later ones reuse it)')
      print(f"{'rep':>3}  {'Linen median s':>14}  {'NNX median s':>12}  {'NNX/Linen':>9}")
    print(f'{rep:>3}  {rows[-1][0]:>14.4f}  {rows[-1][1]:>12.4f}  {rows[-1][1] / rows[-1][0]:>9.4f}',
          flush=True)
  ratios = [n / l for l, n in rows]
  load_after = os.getloadavg()
  summary = {
      'preset': args.preset,
      'scenario': args.scenario,
      'repetitions': args.repetitions,
      'steps': args.steps,
      'linen_median_s': statistics.median(l for l, _ in rows),
      'nnx_median_s': statistics.median(n for _, n in rows),
      'ratio_median': statistics.median(ratios),
      'ratio_min': min(ratios),
      'ratio_max': max(ratios),
      'pair_ratio_median': statistics.median(pair_ratios),
      'pair_ratio_p10': _quantile(pair_ratios, 0.1),
      'pair_ratio_p90': _quantile(pair_ratios, 0.9),
      'load_average_before': load_before[0],
      'load_average_after': load_after[0],
      'cpu_count': os.cpu_count(),
      'wall_s': time.perf_counter() - start,
  }
  print(
      f"NNX/Linen step time: median of {args.repetitions} runs {summary['ratio_median']:.4f}"
      f" (min {summary['ratio_min']:.4f}, max {summary['ratio_max']:.4f});"
      f" paired steps: median {summary['pair_ratio_median']:.4f},"
      f" 10-90% {summary['pair_ratio_p10']:.4f}-{summary['pair_ratio_p90']:.4f}"
  )
  print(
      f"median step: Linen {summary['linen_median_s']:.4f} s, NNX {summary['nnx_median_s']:.4f} s;"
      f" load average {load_before[0]:.2f} -> {load_after[0]:.2f} on {os.cpu_count()} CPUs"
      ' (a load near or above the CPU count means other work shared the machine)'
  )
  goal = 0.98 <= summary['ratio_median'] <= 1.02
  print(f"goal 0.98-1.02: {'met' if goal else 'NOT met'}; {summary['wall_s']:.0f} s")
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(summary, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
