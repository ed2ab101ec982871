"""The train states the battery trains are the model packages' own, and they match.

Both sides build their state with their package's `create_train_state`
(parity/sides.py); here, per scenario, the two states carried into the
checkpoint layout have the same leaves (paths, shapes, dtypes), the step
counter's dtype aside (Linen int32, `nnx.Optimizer` uint32). A train state
that optimises something else (say, an `nnx.Optimizer` whose `wrt` also
takes the fp8 scaling state) has other optimizer leaves and fails here.
"""
import jax
import pytest
from flax import nnx

from models.config import SCENARIOS, get_configs
from models.nnx import train as nnx_train
from parity.sides import make_sides


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
