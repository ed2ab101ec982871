"""Where the suite's jax time goes: tracing, lowering, compiling and cache loads, per test and program.

  .venv/bin/python benchmarks/compile_profile.py [--cold] [--out DIR] [-- PYTEST_ARGS...]
  .venv/bin/python benchmarks/compile_profile.py --records DIR   (a kept run's summary again)

(any Python with the project's test extra installed, as `make test` makes .venv).

Runs pytest (by default as `make test` does: `-n auto --hardware-on-cpu`)
with this file loaded as a plugin in every worker. The plugin listens to
jax's own monitoring events (`jax.monitoring`, public API): the duration of
each jaxpr trace, each lowering to MLIR, and each backend compile, the last
split into real compiles and loads from the persistent compilation cache (a
load is a compile event preceded by a cache retrieval). Each worker writes
its records to DIR; the summary prints totals, the seconds per test file and
per jitted function, the costliest tests, and the floor: the seconds the
two costliest compiles of each xdist group take (a pair's or a scenario's
train step on each side, say), which is what compiling would still cost
if every part of a pair read one program per side.

`--cold` gives the run an empty compilation cache of its own (a temporary
directory, removed afterwards), so every program is compiled; without it the
run uses the suite's usual cache and shows a warm run's costs. Programs that
processes started by tests compile (the multi-process runs, the CLI and the
notebook) are not counted: they run in other processes. Run nothing else
meanwhile; the seconds are the machine's.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

OUT_ENV = 'PARITY_COMPILE_PROFILE_DIR'
EVENTS = {
    '/jax/core/compile/jaxpr_trace_duration': 'trace',
    '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
    '/jax/core/compile/backend_compile_duration': 'compile',
}
RETRIEVAL = '/jax/compilation_cache/cache_retrieval_time_sec'
OWN_PROGRAMS = '/own-programs'  # parity.battery.parts.OWN_PROGRAM_GROUP (not imported: no jax before pytest)
MESH = '/mesh'  # parity.battery.parts.MESH_GROUP
KINDS = ('trace', 'lower', 'compile', 'load')

# ---------------------------------------------------------------------------
# The plugin (loaded in each pytest process with `-p compile_profile`)
# ---------------------------------------------------------------------------

_state = threading.local()
_records: list[tuple[str, str, str, float]] = []  # (test id, kind, function, seconds)
_current = ['(collection)']
_PATH = pytest.StashKey[str]()


def _listener(event, duration, **kwargs):
  if event == RETRIEVAL:
    _state.retrieved = True
    return
  kind = EVENTS.get(event)
  if kind is None:
    return
  if kind == 'compile' and getattr(_state, 'retrieved', False):
    kind = 'load'
  if kind in ('compile', 'load'):
    _state.retrieved = False
  name = str(kwargs.get('fun_name', '?'))
  if name.startswith('jit(') and name.endswith(')'):
    name = name[4:-1]
  _records.append((_current[0], kind, name, float(duration)))


def pytest_configure(config):
  if not os.environ.get(OUT_ENV):
    return
  import jax

  jax.monitoring.register_event_duration_secs_listener(_listener)
  config.stash[_PATH] = os.path.join(
      os.environ[OUT_ENV], os.environ.get('PYTEST_XDIST_WORKER', 'main') + '.json'
  )


def pytest_runtest_logstart(nodeid, location):
  del location
  _current[0] = nodeid


def pytest_unconfigure(config):
  path = config.stash.get(_PATH, None)
  if path:
    with open(path, 'w') as f:
      json.dump(_records, f)

# ---------------------------------------------------------------------------
# The runner and its summary
# ---------------------------------------------------------------------------


def summarise(records: list[tuple[str, str, str, float]], top: int = 15) -> str:
  totals = collections.Counter()
  counts = collections.Counter()
  by_file = collections.defaultdict(collections.Counter)
  by_function = collections.defaultdict(collections.Counter)
  function_counts = collections.defaultdict(collections.Counter)
  by_test = collections.Counter()
  for test, kind, name, seconds in records:
    totals[kind] += seconds
    counts[kind] += 1
    by_file[test.split('::', 1)[0]][kind] += seconds
    by_function[name][kind] += seconds
    function_counts[name][kind] += 1
    by_test[test] += seconds

  def row(label, c):
    return f'{sum(c[k] for k in KINDS):10.1f}' + ''.join(f'{c[k]:10.1f}' for k in KINDS) + f'  {label}'

  head = f'{"total s":>10}' + ''.join(f'{k + " s":>10}' for k in KINDS)
  lines = ['All pytest processes (tests start other processes too; those are not counted)', head,
           row('all', totals),
           '  events: ' + ', '.join(f'{counts[k]} {k}' for k in KINDS), '', 'Per test file', head]
  for name, c in sorted(by_file.items(), key=lambda kv: -sum(kv[1].values())):
    lines.append(row(name, c))
  lines += ['', f'Per jitted function (the {top} costliest; compiles and loads counted)', head]
  for name, c in sorted(by_function.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
    n = function_counts[name]
    lines.append(row(f'{name} ({n["compile"]} compiled, {n["load"]} loaded)', c))
  lines += ['', f'The {top} costliest tests (seconds of jax tracing, lowering, compiling and loading)']
  lines += [f'{s:10.1f}  {t}' for t, s in by_test.most_common(top)]
  floor, groups = compile_floor(records)
  lines += ['', 'The floor: compiling only the two costliest programs of each xdist group (a pair, or a'
                " scenario: one program per side that every part reads), the group's compiles beside it",
            f'{floor:10.1f}  of {totals["compile"]:.1f} s compiling, in {len(groups)} groups']
  lines += [f'{two:10.1f}{every:10.1f}  {group}' for group, (two, every) in groups[:top]]
  return '\n'.join(lines)


def group_of(test: str) -> str:
  """The xdist group a test id names (`...@group`), its pair's when the group is one of the pair's
  own-programs or mesh groups (parity/battery/parts.py); the test's file where it names none."""
  if '@' in test:
    return test.rsplit('@', 1)[1].removesuffix(OWN_PROGRAMS).removesuffix(MESH)
  return test.split('::', 1)[0]


def compile_floor(records) -> tuple[float, list[tuple[str, tuple[float, float]]]]:
  """(The seconds of the two costliest compiles of each group, summed; each group's (those two,
  every compile), the costliest first): what a run that compiled one program per side of each pair
  would still spend compiling, on this machine."""
  by_group = collections.defaultdict(list)
  for test, kind, _, seconds in records:
    if kind == 'compile':
      by_group[group_of(test)].append(seconds)
  groups = {g: (sum(sorted(s, reverse=True)[:2]), sum(s)) for g, s in by_group.items()}
  ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
  return sum(two for two, _ in groups.values()), ranked


def _read(out: str) -> list[tuple[str, str, str, float]]:
  records = []
  for name in sorted(os.listdir(out)):
    if name.endswith('.json'):
      with open(os.path.join(out, name)) as f:
        records += [tuple(r) for r in json.load(f)]
  return records


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--cold', action='store_true', help='an empty compilation cache of its own')
  parser.add_argument('--out', help='keep the per-worker records here (default: a temporary directory)')
  parser.add_argument('--records', help='summarise the records a run kept here (its --out), running nothing')
  parser.add_argument('pytest_args', nargs='*', help='after --: pytest arguments (default: -n auto --hardware-on-cpu)')
  args = parser.parse_args(argv)
  if args.records:
    print(summarise(_read(args.records)))
    return 0
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = args.out or tempfile.mkdtemp(prefix='parity-compile-profile-')
  os.makedirs(out, exist_ok=True)
  env = dict(os.environ)
  env[OUT_ENV] = out
  here = os.path.dirname(os.path.abspath(__file__))
  env['PYTHONPATH'] = os.pathsep.join(p for p in (here, env.get('PYTHONPATH')) if p)
  cache = None
  if args.cold:
    cache = tempfile.mkdtemp(prefix='parity-compile-profile-cache-')
    env['JAX_COMPILATION_CACHE_DIR'] = cache
  pytest_args = args.pytest_args or ['-n', 'auto', '--hardware-on-cpu']
  try:
    status = subprocess.call(
        [sys.executable, '-m', 'pytest', '-p', 'compile_profile', *pytest_args], cwd=root, env=env
    )
  finally:
    if cache:
      shutil.rmtree(cache, ignore_errors=True)
  print()
  print(summarise(_read(out)))
  print(f'\nrecords: {out}')
  return status


if __name__ == '__main__':
  sys.exit(main())
