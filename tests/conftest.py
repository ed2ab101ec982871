"""Shared fixtures. Module- and session-scoped so each worker compiles once."""
from __future__ import annotations

import pytest

from models.config import SCENARIOS, get_preset
from bridge.sides import make_sides
from tests import tiers

# Projects that tests copy elsewhere and run there (a user's own `models.py` and
# `bridge.py` among them): never collected here.
collect_ignore = ['fixtures']


@pytest.fixture(scope='session')
def tiny_cfgs():
  return get_preset('tiny')


@pytest.fixture(scope='session')
def tiny_sides(tiny_cfgs):
  return make_sides(*tiny_cfgs)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
  """Tests of one scenario share an xdist group (run with `--dist loadgroup`); the
  exhaustive tier is left out unless asked for (tests/tiers.py).

  A scenario's side-by-side runs are cached per process (tests/runs.py), so
  keeping its tests in one worker computes each run once.
  """
  for item in items:
    scenario = tiers.string_param(item, 'scenario')
    if scenario is not None:
      item.add_marker(pytest.mark.xdist_group(scenario))
  tiers.select(config, items, SCENARIOS)
