"""Shared fixtures. Module- and session-scoped so each worker compiles once."""
from __future__ import annotations

import pytest

from models.config import get_preset
from parity.sides import make_sides


@pytest.fixture(scope='session')
def tiny_cfgs():
  return get_preset('tiny')


@pytest.fixture(scope='session')
def tiny_sides(tiny_cfgs):
  return make_sides(*tiny_cfgs)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
  """Tests of one scenario share an xdist group (run with `--dist loadgroup`).

  A scenario's side-by-side runs are cached per process (tests/runs.py), so
  keeping its tests in one worker computes each run once.
  """
  del config
  for item in items:
    callspec = getattr(item, 'callspec', None)
    scenario = callspec.params.get('scenario') if callspec else None
    if isinstance(scenario, str):
      item.add_marker(pytest.mark.xdist_group(scenario))


_GROUPING_ERROR = pytest.StashKey[str]()


def pytest_collection_finish(session):
  """In an xdist worker, fail every test if `--dist loadgroup` is not grouping.

  xdist sends a group to one worker by suffixing the test id with `@group`.
  Where that does not take effect (pytest-dev/pytest-xdist#1386: pytest 9.2
  with xdist 3.8), workers would repeat each other's compilations and runs
  and the suite would silently take longer.
  """
  if not getattr(session.config.option, 'loadgroup', False):
    return
  lost = [
      item.nodeid for item in session.items
      if item.get_closest_marker('xdist_group') and '@' not in item.nodeid.rsplit(']', 1)[-1]
  ]
  if lost:
    session.config.stash[_GROUPING_ERROR] = (
        f'--dist loadgroup is not grouping tests here ({len(lost)} grouped tests lack their'
        f' @group suffix): pytest {pytest.__version__} with this pytest-xdist is'
        " pytest-dev/pytest-xdist#1386. Install the test extra (pip install -e '.[test]'),"
        ' which pins a pytest that works, or run without -n.'
    )


def pytest_runtest_setup(item):
  error = item.config.stash.get(_GROUPING_ERROR, None)
  if error:
    pytest.fail(error, pytrace=False)
