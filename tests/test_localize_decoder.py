"""The localizer on the reference decoder: planted bugs on the NNX side, named by module and pass.

Each bug is planted by replacing one NNX layer's `__call__` for the test
(monkeypatch), with a training config of its own so that no compiled
function of another test is reused. `bridge.reference.run_compare` trains both
sides, finds the first divergent step and runs the localizer on it; the
layers are scanned, so the localizer probes the unscanned twin of the same
state and reports the stack's path with the layer index.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from models.config import get_configs, replace
from models.nnx import layers as nnx_layers
from parity.run import report
from parity.run import runner
from bridge import reference

pytestmark = pytest.mark.xdist_group('localize-decoder')


def _rms_norm_with_another_epsilon(self, x):
  """models/nnx/layers.RMSNorm.__call__ with the epsilon ten times larger (the planted bug)."""
  cfg = self.config
  dtype = jnp.dtype(cfg.activation_dtype)
  x32 = x.astype(jnp.float32)
  mean_sq = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  y = (x32 * jax.lax.rsqrt(mean_sq + cfg.norm_epsilon * 10)).astype(dtype)
  return y * self.scale[...].astype(dtype)


def _mlp_with_the_gate_swapped(self, x_BLE):
  """models/nnx/layers.MLP.__call__ with silu on the up projection instead of the gate."""
  gate_BLM = self.wi_0(x_BLE)
  up_BLM = self.wi_1(x_BLE)
  return self.wo(jax.nn.silu(up_BLM) * gate_BLM)


def _run(seed: int):
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  return reference.run_compare(model_cfg, replace(train_cfg, seed=seed), steps=2, program_diff=False)


@pytest.mark.exhaustive
def test_a_changed_rms_norm_epsilon_points_at_the_first_norm_of_layer_0(monkeypatch):
  monkeypatch.setattr(nnx_layers.RMSNorm, '__call__', _rms_norm_with_another_epsilon)
  result = _run(seed=9101)
  assert result.first_divergent_step == 0
  first = result.first_divergent_module
  assert first == {
      'step': 0, 'path': 'decoder/layers/pre_self_attention_layer_norm', 'layer': 0, 'iteration': None,
      'pass': 'forward', 'max_ulp': first['max_ulp'],
  }, result.localizer
  assert first['max_ulp'] >= 1
  text = report.Report(result, 'tiny', '01_baseline').text()
  assert ('first divergent module: decoder/layers/pre_self_attention_layer_norm, layer 0,'
          ' forward pass') in text


@pytest.mark.exhaustive
def test_a_swapped_mlp_gate_points_at_the_mlp_of_layer_0(monkeypatch):
  monkeypatch.setattr(nnx_layers.MLP, '__call__', _mlp_with_the_gate_swapped)
  result = _run(seed=9102)
  first = result.first_divergent_module
  assert (first['path'], first['layer'], first['pass']) == ('decoder/layers/mlp', 0, 'forward'), (
      result.localizer
  )
  assert any('inside module decoder/layers_0/mlp, outside its submodules' in l for l in result.localizer)


def test_equal_sides_run_no_localizer():
  result = _run(seed=9103)
  assert result.bitwise_equal
  assert result.first_divergent_module is None and result.localizer is None


@pytest.mark.exhaustive  # eager, both sides' eval steps: about 18 s on 2 cores
def test_a_model_eval_forgotten_in_the_nnx_eval_step_is_named_at_the_first_dropout(monkeypatch):
  """The reference's NNX eval step calls `model.eval()`; without it (flax's `Module.eval` a no-op
  for the test) its dropouts stay on in eval mode. Training is not touched, and the eval
  localizer, which runs both eval steps eagerly from one state, names the first dropout
  and the side that left its input unchanged."""
  from flax import nnx

  from bridge.sides import as_jax_batch
  from models import data
  from parity.compare import eval_localize
  from tests.runs import start

  scenario = '11_composite_accum'  # dropout 0.1, scanned layers, remat saving dots
  (linen, nnx_side), states = start(scenario)
  batch = as_jax_batch(data.make_batch(*get_configs('tiny', scenario), step=0))
  monkeypatch.setattr(nnx.Module, 'eval', lambda self, **attributes: None)
  found = eval_localize.localize_eval(*(side.eval_calls(state, batch) for side, state in zip((linen, nnx_side), states)))
  assert found.first() == {'path': 'decoder/Dropout_0', 'model_call': 0, 'unchanged': 'Linen'}, found.lines()
  assert found.unrecorded == (), found.unrecorded  # the rematerialised layers' calls recorded too
  assert found.lines()[0].startswith('eval localizer: first differs at module decoder/Dropout_0 (NNX:'
                                     ' decoder/dropout), run eagerly in eval mode (bfloat16[8, 64, 64]: '), found.lines()

