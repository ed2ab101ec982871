"""Wall time of `make test` on a clean clone: cold (empty compilation cache), then warm.

The README's suite times come from this. It clones the repository's
committed HEAD into a scratch directory (uncommitted changes are not in
it), runs `make test` there with an empty `JAX_COMPILATION_CACHE_DIR` (the
venv is created and the project installed from nothing, then pytest runs:
the cold run), then `make test` again with the same cache (the warm run).
Each run's output streams to the terminal and to a log; pytest's own wall
time is read from its last line. Run nothing else meanwhile: the figures
are the machine's, and they vary between days on the same machine, so
compare figures from one sitting.

  python benchmarks/suite_time.py [--python python3.12] [--warm-runs 1] [--json out.json]

Exit status 0 when every run passed, 1 otherwise (the scratch directory and
its logs are then kept, and their path printed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r'=+ (.*?) in ([0-9.]+)s')


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def _run(argv, cwd, env, log_path) -> tuple[int, float, str]:
  """Runs `argv`, streaming its output to the terminal and `log_path`; (status, wall s, output)."""
  start = time.perf_counter()
  lines = []
  with open(log_path, 'w') as log, subprocess.Popen(
      argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  ) as proc:
    for line in proc.stdout:
      sys.stdout.write(line)
      sys.stdout.flush()
      log.write(line)
      lines.append(line)
  return proc.returncode, time.perf_counter() - start, ''.join(lines)


def _pytest_summary(output: str) -> tuple[str, float | None]:
  found = SUMMARY.findall(output)
  if not found:
    return 'no pytest summary', None
  counts, seconds = found[-1]
  return counts, float(seconds)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
  parser.add_argument('--python', default='python3', help='interpreter for the venv (make PYTHON=...)')
  parser.add_argument('--warm-runs', type=int, default=1, help='warm runs after the cold one')
  parser.add_argument('--json', help='write the figures here as JSON')
  parser.add_argument('--scratch', help='directory for the clone, cache and logs, kept afterwards'
                      ' (default: a new temporary one, removed when every run passed)')
  args = parser.parse_args(argv)

  scratch = args.scratch or tempfile.mkdtemp(prefix='suite-time-')
  os.makedirs(scratch, exist_ok=True)
  clone, cache = os.path.join(scratch, 'clone'), os.path.join(scratch, 'jax-cache')
  if os.path.exists(clone) or os.path.exists(cache):
    parser.error(f'{scratch} already holds a clone or a cache; give an empty --scratch')
  dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
  if dirty:
    print('note: uncommitted changes are not measured (the clone is of HEAD)', flush=True)
  head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True,
                        text=True, check=True).stdout.strip()
  print(f'cloning {head} into {clone}', flush=True)
  subprocess.run(['git', 'clone', '--quiet', ROOT, clone], check=True)
  os.makedirs(cache)

  env = dict(os.environ)
  env['JAX_COMPILATION_CACHE_DIR'] = cache
  make = ['make', 'test', f'PYTHON={args.python}', 'VENV=.venv-suite-time']
  runs = []
  for i in range(1 + args.warm_runs):
    kind = 'cold' if i == 0 else 'warm'
    print(f'\n{kind} run {i}: {" ".join(make)} (cache {"empty" if i == 0 else "from the runs before"})',
          flush=True)
    status, wall, output = _run(make, clone, env, os.path.join(scratch, f'run{i}-{kind}.log'))
    counts, pytest_s = _pytest_summary(output)
    runs.append({'kind': kind, 'status': status, 'make_wall_s': round(wall, 1),
                 'pytest_wall_s': pytest_s, 'result': counts})
    print(f'{kind} run {i}: exit {status}, make {wall:.1f} s, pytest {pytest_s} s ({counts})', flush=True)
    if status != 0:
      break

  venv_python = os.path.join(clone, '.venv-suite-time', 'bin', 'python')
  versions = []
  if os.path.exists(venv_python):  # absent when the venv could not be made
    versions = subprocess.run(
        [venv_python, '-c', 'import sys, jax, flax; print(sys.version.split()[0], jax.__version__, flax.__version__)'],
        capture_output=True, text=True,
    ).stdout.split()
  figures = {
      'commit': head,
      'python': versions[0] if versions else None,
      'jax': versions[1] if len(versions) > 1 else None,
      'flax': versions[2] if len(versions) > 2 else None,
      'cpu': _cpu_model(),
      'cores': os.cpu_count(),
      'runs': runs,
  }
  print('\n' + json.dumps(figures, indent=2))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(figures, f, indent=2)
  ok = len(runs) == 1 + args.warm_runs and all(r['status'] == 0 for r in runs)
  if ok and not args.scratch:
    shutil.rmtree(scratch, ignore_errors=True)
  elif not ok:
    print(f'a run failed; its clone and logs are kept in {scratch}', file=sys.stderr)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
