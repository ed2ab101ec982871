"""The train states the battery trains are the model packages' own, and they match.

Both sides build their state with their package's `create_train_state`
(bridge/sides.py); here, per scenario, the two states carried into the
checkpoint layout have the same leaves (paths, shapes, dtypes), the step
counter's dtype aside (Linen int32, `nnx.Optimizer` uint32). A train state
that optimises something else (say, an `nnx.Optimizer` whose `wrt` also
takes the fp8 scaling state) has other optimizer leaves and fails here.
"""
import functools

import jax
import pytest
from flax import nnx

from models import data, rng
from models.config import SCENARIOS, get_configs
from models.linen import train as linen_train
from models.nnx import train as nnx_train
from bridge.sides import LinenSide, NnxSide, make_sides


def _leaves(side):
  return {p: (x.shape, str(x.dtype)) for p, x in side.abstract_checkpoint().items() if p != 'step'}


@pytest.mark.parametrize('scenario', sorted(SCENARIOS))
def test_both_train_states_have_the_same_leaves(scenario):
  linen, nnx_side = make_sides(*get_configs('tiny', scenario))
  linen_leaves, nnx_leaves = _leaves(linen), _leaves(nnx_side)
  only = sorted(set(linen_leaves) ^ set(nnx_leaves))
  assert only == [], f'leaves on one side only: {only}'
  assert {p: x for p, x in nnx_leaves.items() if linen_leaves[p] != x} == {}


def test_the_battery_trains_the_state_create_train_state_builds():
  model_cfg, train_cfg = get_configs('tiny', '05_fp8')
  _, nnx_side = make_sides(model_cfg, train_cfg)
  _, state = nnx.eval_shape(
      lambda: nnx_train.create_train_state(model_cfg, train_cfg, nnx_train.init_model(model_cfg, 0))
  )
  assert jax.tree.structure(state) == jax.tree.structure(nnx_side.template)


def _spied(module, names, monkeypatch) -> list[str]:
  """Each of `module`'s functions `names` replaced by a wrapper that records its call."""
  called = []
  for name in names:
    original = getattr(module, name)

    @functools.wraps(original)
    def spy(*args, _original=original, _name=name, **kwargs):
      called.append(_name)
      return _original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
  return called


@pytest.mark.parametrize('side_type,module', [(LinenSide, linen_train), (NnxSide, nnx_train)],
                         ids=['linen', 'nnx'])
def test_each_side_builds_its_state_and_step_with_its_packages_own_functions(side_type, module, monkeypatch):
  """The harness holds no copy of the train state, optimizer or step: a fresh side
  (not the process's shared one) asks the model package for each (spied on here),
  and the optimizer its state steps with is the one the package made."""
  called = _spied(module, ('create_train_state', 'make_train_step'), monkeypatch)
  made = []
  original = module.make_optimizer
  monkeypatch.setattr(module, 'make_optimizer', lambda *a, **k: made.append(original(*a, **k)) or made[-1])
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  side = side_type(model_cfg, train_cfg)
  state = side.template
  assert called == ['create_train_state'] and len(made) == 1
  if side_type is LinenSide:
    tx = state.tx
  else:
    _, optimizer = nnx.merge(side.graphdef, state)
    tx = optimizer.tx
  assert tx is made[0]
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
           for k, v in data.make_batch(model_cfg, train_cfg, 0).items()}
  key = jax.eval_shape(lambda: rng.base_key(0))
  side.lower_train_step(state, batch, key)  # traced, not compiled
  assert called[1:] == ['make_train_step']
