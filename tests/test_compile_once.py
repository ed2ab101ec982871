"""A side traces each of its steps once per process, however often it is called.

The suite's warm time rests on it: tests share a side's jitted functions
(`bridge.sides.make_sides`, and the models' `make_*_step` functions cached per
config), and jax's persistent cache spares only the compile, not the tracing
and lowering before it (0.1 to 0.3 s a call on the tiny preset). With
`functools.cache` taken off `models/linen/train.py`'s `make_eval_step`, the
Linen eval step fails here.
"""
import contextlib

import jax
import pytest

from models import data, rng
from models.config import get_configs
from bridge.sides import as_jax_batch
from tests import tiers
from tests.runs import start

TRACE_EVENT = '/jax/core/compile/jaxpr_trace_duration'
SCENARIO = tiers.CORE_SCENARIOS[0]  # the core tier's decoder group, whose sides its other tests use


@contextlib.contextmanager
def traces():
  """The jaxpr traces jax makes inside the block (a list, filled as they happen)."""
  seen = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == TRACE_EVENT:
      seen.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


CALLS = {
    'train_step': lambda side, state, batch, key: side.train_step(state, batch, key),
    'eval_step': lambda side, state, batch, key: side.eval_step(state, batch),
    'loss_and_grad': lambda side, state, batch, key: side.loss_and_grad(state, batch, key),
    'forward': lambda side, state, batch, key: side.forward(state, batch, key),
}


@pytest.mark.parametrize('scenario', [SCENARIO])
@pytest.mark.parametrize('call', sorted(CALLS))
@pytest.mark.parametrize('index', [0, 1], ids=['linen', 'nnx'])
def test_a_second_call_traces_nothing(scenario, call, index):
  sides, states = start(scenario)
  side, state = sides[index], states[index]
  batch = as_jax_batch(data.make_batch(*get_configs('tiny', scenario), step=0))
  key = rng.base_key(0)
  jax.block_until_ready(CALLS[call](side, state, batch, key))  # may trace (or an earlier test did)
  with traces() as second:
    jax.block_until_ready(CALLS[call](side, state, batch, key))
  assert second == [], f'{side.name} {call}: traced again on a second call ({len(second)} traces)'


def test_the_counter_sees_a_trace():
  """A new jitted function traces on its first call: the check above can fail."""
  with traces() as seen:
    jax.jit(lambda x: x * 2)(1.0).block_until_ready()
  assert len(seen) == 1
