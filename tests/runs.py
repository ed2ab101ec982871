"""Side-by-side runs shared by test modules: each (scenario, init side) runs once per process."""
import functools

from models.config import get_configs
from parity.runner import CompareResult, run_compare

STEPS = 10


@functools.cache
def tiny_run(scenario: str = '01_baseline', init_side: str = 'linen') -> CompareResult:
  return run_compare(*get_configs('tiny', scenario), steps=STEPS, init_side=init_side)
