"""The garbage collector's thresholds (parity/env/gc_tuning.py)."""
import gc

import pytest

from parity.env import gc_tuning


@pytest.fixture
def thresholds():
  saved = gc.get_threshold()
  yield
  gc.set_threshold(*saved)


def test_the_suite_runs_with_the_tuned_thresholds():
  assert gc.get_threshold() == gc_tuning.THRESHOLDS


def test_defaults_are_raised(thresholds):
  gc.set_threshold(700, 10, 10)
  gc_tuning.tune()
  assert gc.get_threshold() == gc_tuning.THRESHOLDS


def test_a_higher_threshold_is_kept(thresholds):
  gc.set_threshold(10**6, 10, 100)
  gc_tuning.tune()
  assert gc.get_threshold() == (10**6, gc_tuning.THRESHOLDS[1], 100)


def test_a_collector_turned_off_stays_off(thresholds):
  gc.set_threshold(0, 10, 10)
  gc_tuning.tune()
  assert gc.get_threshold() == (0, 10, 10)
