"""The suite's tiers (tests/tiers.py): what a whole-suite run leaves out, and what brings it back.

The first test collects the suite twice in new pytest processes (collection
only: no test runs, nothing compiles) from the repository root, as `make
test` and `make test-all` do; the second checks when a run is the core tier.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from models.config import SCENARIOS
from tests import tiers

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _collected(*args: str) -> list[str]:
  done = subprocess.run(
      [sys.executable, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider',
       '--hardware-on-cpu', *args],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={k: v for k, v in os.environ.items() if k != 'PYTEST_ADDOPTS'},
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return [line for line in done.stdout.splitlines() if '::' in line]


def test_a_whole_suite_run_is_the_core_tier_and_exhaustive_adds_the_rest():
  core, every = _collected(), _collected('--exhaustive')
  assert set(core) < set(every)
  batteries_in = lambda ids: {s for s in SCENARIOS if any(f'decoder_{s}::' in i for i in ids)}
  trained_in = lambda ids: {
      s for s in SCENARIOS if any(f'test_scenario_trains_bit_identically[{s}]' in i for i in ids)
  }
  # The core tier trains its scenarios side by side (with their records) and runs the battery
  # of those it keeps whole; the exhaustive tier adds every other scenario.
  assert trained_in(core) == set(tiers.CORE_SCENARIOS)
  assert batteries_in(core) == {s for s in tiers.CORE_SCENARIOS if s not in tiers.CORE_SCENARIO_TESTS}
  assert batteries_in(core)
  assert trained_in(every) == batteries_in(every) == set(SCENARIOS)
  # Every file keeps a test in the core tier but those that are all one scenario's or all
  # multi-process; the three families' batteries are in it.
  for pair in ('classifier::', 'encoder::', 'encoder_stock_attention::'):
    assert any(pair in i for i in core), pair
  left_out = set(every) - set(core)
  assert any('test_multihost.py::test_two_processes_are_bit_identical' in i for i in left_out)
  assert any('test_notebook.py::test_notebook_runs_top_to_bottom' in i for i in left_out)


class _Config:
  """What `tiers.core_only` reads of a pytest config."""

  def __init__(self, exhaustive=False, source='TESTPATHS', markexpr='', keyword='', workerinput=None):
    self._options = {'exhaustive': exhaustive, 'markexpr': markexpr, 'keyword': keyword}
    self.args_source = getattr(pytest.Config.ArgsSource, source)
    if workerinput is not None:
      self.workerinput = workerinput

  def getoption(self, name, default=None):
    return self._options.get(name, default)


def test_a_named_path_or_marker_runs_what_it_names_whatever_the_tier():
  assert tiers.core_only(_Config())
  assert not tiers.core_only(_Config(exhaustive=True))
  assert not tiers.core_only(_Config(source='ARGS'))  # pytest tests/test_multihost.py
  assert not tiers.core_only(_Config(markexpr='hardware'))  # pytest -m hardware
  assert not tiers.core_only(_Config(keyword='multihost'))
  # An xdist worker sees the paths the main process expanded: it takes the main process's choice.
  assert tiers.core_only(_Config(source='ARGS', workerinput={tiers.WORKER_INPUT: True}))
  assert not tiers.core_only(_Config(workerinput={tiers.WORKER_INPUT: False}))
