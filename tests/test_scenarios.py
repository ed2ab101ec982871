"""Every scenario: 10 steps side by side, bitwise; spec tables; a golden loss record.

The golden loss record (tests/golden/losses/jax-X.Y/<scenario>.txt, one hex
float per step) catches a change that moves both sides alike, which a
side-by-side comparison cannot. XLA's CPU code generation differs between jax
minor versions, so there is one record per jax minor version; a version with
no record fails and says how to create it.
"""
import jax
import numpy as np
import pytest

from bridge.layout import layout_for
from models import data, rng
from models.config import SCENARIOS, get_configs, replace
from parity import tables
from parity.runner import run_compare
from parity.sides import as_jax_batch, make_sides
from tests.golden import check_golden
from tests.runs import tiny_run as _run
JAX_MINOR = '.'.join(jax.__version__.split('.')[:2])


@pytest.mark.parametrize('scenario', sorted(SCENARIOS))
def test_scenario_trains_bit_identically(scenario):
  result = _run(scenario)
  assert result.first_divergent_step is None, result.verdict()
  assert result.state_diffs == [], '\n'.join(result.state_diffs)
  assert result.linen.loss_hex == result.nnx.loss_hex
  lines = ''.join(f'{step} {h}\n' for step, h in enumerate(result.linen.loss_hex))
  check_golden(f'losses/jax-{JAX_MINOR}/{scenario}.txt', lines)


@pytest.mark.parametrize('scenario', ['02_unscanned', '10_scan_axis0'])
def test_scenario_nnx_init_direction(scenario):
  result = _run(scenario, 'nnx')
  assert result.bitwise_equal, result.verdict() + '\n' + '\n'.join(result.state_diffs)


@pytest.mark.parametrize('scenario', sorted(SCENARIOS))
def test_scenario_specs_agree(scenario):
  model_cfg, train_cfg = get_configs('tiny', scenario)
  linen, nnx_side = make_sides(model_cfg, train_cfg)
  linen_rows, nnx_rows = tables.linen_rows(linen), tables.nnx_rows(nnx_side)
  assert tables.drift(linen_rows, nnx_rows, layout_for(model_cfg)) == []
  assert tables.param_count(linen_rows) == model_cfg.param_count()
  paths = {r['path'] for r in linen_rows}
  dtypes = {r['dtype'] for r in linen_rows + nnx_rows}
  assert dtypes == {'bfloat16' if scenario == '08_bf16_weights' else 'float32'}
  assert any('logits_dense' in p for p in paths) == (scenario != '09_tied_logits')
  assert any('/layers_1/' in p for p in paths) == (scenario == '02_unscanned')
  if scenario == '10_scan_axis0':
    differing = [a['path'] for a, b in zip(linen_rows, nnx_rows) if a != b]
    assert differing and all('/layers/' in p for p in differing)


def test_dropout_is_not_vacuous():
  baseline, dropout = _run('01_baseline'), _run('03_dropout')
  assert all(a != b for a, b in zip(baseline.linen.loss_hex, dropout.linen.loss_hex))


def test_dropout_keys_differ_between_steps_layers_microbatches_and_sites():
  base = rng.base_key(0)
  step_keys = [rng.step_key(base, s, m) for s in range(3) for m in range(4)]
  layer_keys = [k for sk in step_keys for k in rng.layer_keys(sk, 4)]
  site_keys = [rng.site_key(k, site) for k in layer_keys for site in rng.Site]
  site_keys += [rng.embedding_key(k) for k in step_keys]
  bits = {np.asarray(k).tobytes() for k in site_keys}
  assert len(bits) == len(site_keys)


def test_dropout_masks_change_between_steps_on_both_sides(tiny_cfgs):
  """Same params, same batch, two step counters: the logits must differ (new masks)."""
  model_cfg, train_cfg = get_configs('tiny', '03_dropout')
  linen, nnx_side = make_sides(model_cfg, train_cfg)
  state = linen.init(0)
  batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, 0))
  base = rng.base_key(0)
  for side, s in ((linen, state), (nnx_side, nnx_side.from_checkpoint(linen.to_checkpoint(state)))):
    a = side.forward(s, batch, rng.step_key(base, 0, 0))
    b = side.forward(s, batch, rng.step_key(base, 1, 0))
    c = side.forward(s, batch, rng.step_key(base, 0, 1))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_grad_accum_matches_one_big_batch_within_bound():
  """4 microbatches of 2 vs one batch of 8, no dropout: close, not bitwise.

  Steps 0 and 1 see identical parameters (the warmup schedule's learning
  rate is 0 at step 0), so their losses differ only in the order of the
  per-token sums (four partial sums then their sum, against one reduction):
  ~450 float32 terms, bound 1e-5 relative. From step 2 on the parameters
  differ slightly too: the weight gradients contract bfloat16 activations
  over 2 rows instead of 8 (another reduction order), and Adam's first
  updates are close to lr * sign(g), which magnifies differences in
  near-zero gradient entries; bound 1e-3 relative there.
  """
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  accum_train_cfg = replace(train_cfg, grad_accum_steps=4)
  one = _run('01_baseline').linen.losses
  four = run_compare(model_cfg, accum_train_cfg, steps=3).linen.losses
  for step, (a, b) in enumerate(zip(one, four)):
    bound = 1e-5 if step < 2 else 1e-3
    assert abs(a - b) <= bound * abs(a), (step, a, b)
  assert one[:3] != four, 'accumulation did not change the reduction at all: is it running?'
