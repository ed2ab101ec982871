"""Wall time of one small pair's battery: the language model declared at model level.

  .venv/bin/python benchmarks/pair_battery_time.py [--workers 2] [--warm-runs 1] [--json out.json]

Runs `pytest -n WORKERS tests/test_family_lm_model_level.py::lm_model_level` (the
pair's 21 parts, decoding included) in this checkout, first with an empty
compilation cache of its own (cold: every program compiled), then again with
that cache (warm). A user's single pair costs what this costs: the figures in
docs/first-pair.md come from it. Run nothing else meanwhile; the seconds are
the machine's. Exit status 0 when every run passed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = 'tests/test_family_lm_model_level.py::lm_model_level'
SUMMARY = re.compile(r'^=*\s*(\d+ (?:passed|failed).*?) in ([0-9.]+)s', re.MULTILINE)


def _run(workers: int, cache: str) -> dict:
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache)
  argv = [sys.executable, '-m', 'pytest', '-n', str(workers), PAIR, '-q', '-p', 'no:cacheprovider']
  start = time.perf_counter()
  proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - start
  found = SUMMARY.findall(proc.stdout)
  summary, pytest_s = found[-1] if found else ((proc.stdout.strip().splitlines() or ['?'])[-1], 'nan')
  if proc.returncode:
    sys.stdout.write(proc.stdout[-4000:] + proc.stderr[-2000:])
  return {'status': proc.returncode, 'summary': summary, 'pytest_s': float(pytest_s), 'wall_s': round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--workers', type=int, default=2, help='xdist workers (default 2)')
  parser.add_argument('--warm-runs', type=int, default=1)
  parser.add_argument('--json', help='write the figures here too')
  args = parser.parse_args(argv)
  cache = tempfile.mkdtemp(prefix='parity-pair-bench-cache-')
  runs = []
  try:
    for i in range(1 + args.warm_runs):
      kind = 'cold' if i == 0 else 'warm'
      print(f'{kind} run, {args.workers} worker(s) ...', flush=True)
      runs.append(dict(_run(args.workers, cache), kind=kind))
      print(f"  {runs[-1]['summary']}: pytest {runs[-1]['pytest_s']} s, wall {runs[-1]['wall_s']} s", flush=True)
  finally:
    shutil.rmtree(cache, ignore_errors=True)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'pair': PAIR, 'workers': args.workers, 'cpus': os.cpu_count(), 'runs': runs}, f, indent=2)
  return 0 if all(r['status'] == 0 for r in runs) else 1


if __name__ == '__main__':
  sys.exit(main())
