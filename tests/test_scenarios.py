"""Every scenario: 10 steps side by side, bitwise; spec tables; a golden loss record.

(The other init direction, NNX initialising, is the plugin's
`decoder_<scenario>::test_train[nnx]` in test_decoder_pairs.py.)

The golden loss record (tests/golden/losses/jax-X.Y/<scenario>.txt, one hex
float per step) catches a change that moves both sides alike, which a
side-by-side comparison cannot. The records are exact; they are meant to
hold on any x86-64 CPU with AVX2 and FMA because the suite runs XLA:CPU with
`parity.env.xla_env.portable_cpu_flags()` (root conftest.py): without them the
kernels, vector width, math approximations and thread split follow the host
and the bits move by about 1e-5 from step 2 on. Measured with the flags: the
same bits on an AMD EPYC with AVX-512 and on one core of it, and under qemu's
Intel Haswell model for every scenario but 05_fp8. 05_fp8 leaves its record
there from step 2 because of qemu, not of the CPU it models: XLA:CPU runs
with the MXCSR's flush-to-zero and denormals-are-zero bits set and converts
bf16 to e5m2 through float16, and the e5m2 gradients (about 2**-16) are
float16 denormals there. The F16C conversions (vcvtps2ph, vcvtph2ps) ignore
those bits on x86 CPUs (Intel's manual); qemu 7.2 flushes them, so step 0's
gradients already differ under it, and the loss from step 2.
test_fp8.test_the_cpu_keeps_the_e5m2_gradients_denormals checks this
conversion on the host, and fails under qemu. Not checked on a real second
CPU. The composites (11_composite_accum, 12_composite_fp8: the core tier's)
were recorded after those measurements, on one host; 12_composite_fp8 has
fp8's e5m2 gradients too. Changing the z-loss
weight or the RoPE timescale in the shared config fails every record. XLA's CPU code generation
still differs between jax minor versions, so there is one record per jax
minor version; a version with no record fails and says how to create it.
"""
import functools
import os
import platform

import jax
import numpy as np
import pytest

from bridge.layout import layout_for
from models import data, rng
from parity.core import compat
from models.config import SCENARIOS, get_configs, replace
from bridge import tables
from parity.env import xla_env
from parity.core.bitwise import assert_bitwise_equal
from bridge.reference import run_compare
from bridge.sides import as_jax_batch, make_sides
from tests.golden import GOLDEN_DIR, check_golden
from tests.runs import STEPS, start
from tests.runs import tiny_run as _run

JAX_MINOR = compat.jax_minor()


@pytest.mark.parametrize('scenario', sorted(SCENARIOS))
def test_scenario_trains_bit_identically(scenario):
  result = _run(scenario)
  assert result.first_divergent_step is None, result.verdict()
  assert result.state_diffs == [], '\n'.join(result.state_diffs)
  assert result.linen.loss_hex == result.nnx.loss_hex
  assert result.metric_diffs == [[]] * STEPS  # every step's loss, z-loss and token count, bit for bit
  # Training moved the parameters: steps that do nothing would also "match".
  assert len(set(result.linen.loss_hex)) == STEPS, result.linen.loss_hex
  lines = ''.join(f'{step} {h}\n' for step, h in enumerate(result.linen.loss_hex))
  _check_loss_record(f'{scenario}.txt', lines)


@pytest.mark.exhaustive
def test_a_train_metric_other_than_the_loss_is_compared(monkeypatch):
  """An NNX step whose z-loss alone is off (doubled): the runner and the battery see it."""
  from models.nnx import train as nnx_train
  from parity.pairs import adapter
  from parity.battery import checks as battery
  from parity.run import runner
  from bridge import sides

  original = nnx_train.make_train_step

  def doubled_z_loss(model_cfg, train_cfg):
    step = original(model_cfg, train_cfg)

    def train_step(graphdef, state, batch, dropout_base):
      state, metrics = step(graphdef, state, batch, dropout_base)
      return state, dict(metrics, z_loss=metrics['z_loss'] * 2)

    return jax.jit(train_step, static_argnums=0)

  monkeypatch.setattr(nnx_train, 'make_train_step', doubled_z_loss)
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  linen, _ = make_sides(model_cfg, train_cfg)
  broken = sides.NnxSide(model_cfg, train_cfg, None, tuple(tuple(r) for r in sides.specs_lib.DEFAULT_RULES))
  result = runner.compare_sides(
      (linen, broken), lambda step: data.make_batch(model_cfg, train_cfg, step), 2,
      program_diff=False, localize_divergence=False,
  )
  assert result.linen.loss_hex == result.nnx.loss_hex and not result.state_diffs
  assert result.first_divergent_step == 0 and result.verdict() == 'DIVERGED at step 0 (z_loss)'
  assert [[line.split(':')[0] for line in step] for step in result.metric_diffs] == [['z_loss']] * 2

  batch = lambda step, split: data.make_batch(model_cfg, train_cfg, step)
  pair = adapter.Pair('decoder_doubled_z_loss', lambda mesh: (linen, broken), batch, steps=2)
  with pytest.raises(AssertionError, match=r'z_loss/step_0: bits'):
    battery.check_train(pair, 'linen')


def _check_loss_record(name: str, text: str) -> None:
  """`text` against the golden loss record `name` of this jax version."""
  _assert_record_conditions()
  check_golden(f'losses/jax-{JAX_MINOR}/{name}', text)


def _missing_cpu_features() -> list[str]:
  """What this host lacks of the records' CPU: x86-64 with AVX2 and FMA (parity/env/xla_env.py)."""
  if platform.machine().lower() not in ('x86_64', 'amd64'):
    return [f'x86-64 (it is {platform.machine()})']
  try:
    with open('/proc/cpuinfo') as f:
      flags = next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), None)
  except OSError:  # not Linux: the flags are not read here
    return []
  return [] if flags is None else [f for f in ('avx2', 'fma') if f not in flags]


def _assert_record_conditions() -> None:
  """This run has the XLA:CPU set-up the loss records were taken with.

  The records are the bits of the suite's portable flags, its 8 CPU devices
  and 8 CPU-client threads (root conftest.py): XLA:CPU splits large loops
  into one task per thread, and some programs round otherwise with another
  split (parity/env/xla_env.py). A run that overrides any of them fails here
  saying so, not on a record that cannot hold for it.
  """
  missing = _missing_cpu_features()
  if missing:  # no other CPU's bits were recorded: stated, not a golden diff
    pytest.skip(f'the loss records are the bits of x86-64 CPUs with AVX2 and FMA; this host lacks {missing}')
  flags = xla_env.current_flags()
  overridden = [f for f in xla_env.portable_cpu_flags() if f not in flags]
  assert not overridden, (
      f'the loss records are taken with {list(xla_env.portable_cpu_flags())}; XLA_FLAGS sets'
      f' {overridden} otherwise ({flags})'
  )
  cpu_devices = len(jax.devices('cpu'))
  threads = os.environ.get(xla_env.CPU_THREADS_ENV)
  suite = xla_env.SUITE_CPU_DEVICES  # conftest.py sets as many threads as devices
  assert cpu_devices == suite and threads == str(suite), (
      f'the loss records are taken with {suite} CPU devices and'
      f' {xla_env.CPU_THREADS_ENV}={suite}; this run has {cpu_devices}'
      f' and {xla_env.CPU_THREADS_ENV}={threads} (XLA_FLAGS: {flags})'
  )


@pytest.mark.parametrize('scenario', sorted(SCENARIOS))
def test_scenario_specs_agree(scenario):
  model_cfg, train_cfg = get_configs('tiny', scenario)
  linen, nnx_side = make_sides(model_cfg, train_cfg)
  linen_rows, nnx_rows = tables.linen_rows(linen), tables.nnx_rows(nnx_side)
  assert tables.drift(linen_rows, nnx_rows, layout_for(model_cfg)) == []
  assert tables.param_count(linen_rows) == model_cfg.param_count()
  paths = {r['path'] for r in linen_rows}
  dtypes = {r['dtype'] for r in linen_rows + nnx_rows}
  assert dtypes == {model_cfg.weight_dtype}
  assert any('logits_dense' in p for p in paths) == (not model_cfg.logits_via_embedding)
  assert any('/layers_1/' in p for p in paths) == (not model_cfg.scan_layers)
  if layout_for(model_cfg).moves:  # 10_scan_axis0
    differing = [a['path'] for a, b in zip(linen_rows, nnx_rows) if a != b]
    assert differing and all('/layers/' in p for p in differing)


@pytest.mark.exhaustive
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


@pytest.mark.exhaustive
def test_dropout_masks_change_between_steps_on_both_sides():
  """Same params, same batch, two step counters: the logits must differ (new masks)."""
  sides, states = start('03_dropout')
  batch = as_jax_batch(data.make_batch(*get_configs('tiny', '03_dropout'), 0))
  base = rng.base_key(0)
  for side, s in zip(sides, states):
    a = side.forward(s, batch, rng.step_key(base, 0, 0))
    b = side.forward(s, batch, rng.step_key(base, 1, 0))
    c = side.forward(s, batch, rng.step_key(base, 0, 1))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.exhaustive
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
  four = run_compare(model_cfg, accum_train_cfg, steps=3, program_diff=False).linen.losses
  for step, (a, b) in enumerate(zip(one, four)):
    bound = 1e-5 if step < 2 else 1e-3
    assert abs(a - b) <= bound * abs(a), (step, a, b)
  assert one[:3] != four, 'accumulation did not change the reduction at all: is it running?'


def _golden_losses(scenario):
  """The recorded per-step loss hex strings of `scenario` for this jax version."""
  path = GOLDEN_DIR / 'losses' / f'jax-{JAX_MINOR}' / f'{scenario}.txt'
  if not path.exists():
    pytest.skip(f'no golden loss record {path.name} for jax {JAX_MINOR}')
  return [line.split()[1] for line in path.read_text().splitlines()]


def test_remat_policies_agree():
  """Remat policies: `full` and `save_dots` bitwise equal; no remat equal up to XLA excess precision.

  Checked on the golden loss records, which test_scenario_trains_bit_identically
  ties to the code (so this costs no run). `full` and `save_dots` are bitwise
  equal over all 10 steps, and equal to no remat while the parameters are the
  same (steps 0 and 1: the learning rate is 0 at step 0), so the forward pass
  is bitwise too. From step 2 on, no remat differs from remat: on CPU, XLA
  computes chains of bfloat16 elementwise ops inside a fusion in float32 and
  rounds once at the fusion's end (`xla_allow_excess_precision`, on by
  default), and remat moves fusion boundaries in the backward pass. At the
  first step one element of the embedding's gradient differs (by one
  bfloat16 rounding, jax 0.10 and 0.12 alike); with
  XLA_FLAGS=--xla_allow_excess_precision=false the gradients with and
  without remat are bitwise equal. The bound (2**-10 relative, measured
  below 2**-13) allows that rounding carried through 8 Adam steps, not a
  remat that recomputes something else.
  """
  none, full, save_dots = (
      _golden_losses(s) for s in ('01_baseline', '04_remat', '04_remat_save_dots')
  )
  assert full == save_dots
  assert none[:2] == full[:2]
  for step, (a, b) in enumerate(zip(none, full)):
    a, b = float.fromhex(a), float.fromhex(b)
    assert abs(a - b) <= 2.0**-10 * abs(a), (step, a, b)


# The scenarios that evaluate between train steps (`eval_every`): 07_eval and the core
# tier's composites (tests/tiers.py).
EVAL_SCENARIOS = [s for s in sorted(SCENARIOS) if get_configs('tiny', s)[1].eval_every]


@functools.cache
def _eval_run(scenario):
  """`scenario` (07_eval, ...): both sides train 10 steps; every `eval_every` steps both evaluate.

  Returns (per-side train losses, eval rounds, held-out batches). Each round
  is (after how many steps, [(linen, nnx) metrics per held-out batch], both
  states in the checkpoint layout before the round, and after it).
  """
  model_cfg, train_cfg = get_configs('tiny', scenario)
  (linen, nnx_side), (linen_state, nnx_state) = start(scenario)
  base = rng.base_key(0)
  held_out = [
      as_jax_batch(data.make_batch(model_cfg, train_cfg, i, split='eval'))
      for i in range(train_cfg.eval_batches)
  ]
  losses, rounds = ([], []), []
  for step in range(STEPS):
    batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, step))
    linen_state, linen_metrics = linen.train_step(linen_state, batch, base)
    nnx_state, nnx_metrics = nnx_side.train_step(nnx_state, batch, base)
    losses[0].append(linen_metrics['loss'])
    losses[1].append(nnx_metrics['loss'])
    if (step + 1) % train_cfg.eval_every:
      continue
    before = (linen.to_checkpoint(linen_state), nnx_side.to_checkpoint(nnx_state))
    metrics = [
        (linen.eval_step(linen_state, b), nnx_side.eval_step(nnx_state, b)) for b in held_out
    ]
    after = (linen.to_checkpoint(linen_state), nnx_side.to_checkpoint(nnx_state))
    rounds.append((step + 1, metrics, before, after))
  return losses, rounds, held_out


def _hex(x):
  return float(np.asarray(x, np.float32)).hex()


@pytest.mark.parametrize('scenario', EVAL_SCENARIOS)  # and so its xdist group
def test_eval_between_train_steps_bitwise(scenario):
  """Eval metrics on the held-out batches equal bit for bit; a golden records them."""
  _, rounds, held_out = _eval_run(scenario)
  model_cfg, train_cfg = get_configs('tiny', scenario)
  assert len(rounds) == STEPS // train_cfg.eval_every
  lines = []
  for after_step, metrics, _, _ in rounds:
    for i, (linen_metrics, nnx_metrics) in enumerate(metrics):
      assert_bitwise_equal(linen_metrics, nnx_metrics, f'eval after step {after_step}, batch {i}')
      real = int((np.asarray(held_out[i]['segment_ids']) != 0).sum())
      assert float(linen_metrics['tokens']) == real
      assert 0.0 <= float(linen_metrics['accuracy']) <= 1.0
      lines.append(
          f"{after_step} {i} loss={_hex(linen_metrics['loss'])}"
          f" accuracy={_hex(linen_metrics['accuracy'])} tokens={real}\n"
      )
  # Training moves the eval loss; held-out batches are not training batches.
  assert len({line.split()[2] for line in lines}) == len(lines)
  train_batch = data.make_batch(model_cfg, train_cfg, 0)
  assert not np.array_equal(np.asarray(held_out[0]['inputs']), train_batch['inputs'])
  _check_loss_record(f'{scenario}.eval.txt', ''.join(lines))


@pytest.mark.parametrize('scenario', EVAL_SCENARIOS)
def test_eval_changes_nothing_and_has_dropout_off(scenario):
  """Eval leaves the state alone, training around it is unchanged, dropout is off.

  The state is bitwise the same before and after each eval round, and the
  train losses with eval rounds in between equal the scenario's golden record
  (written by the side-by-side runner, which trains without eval). The
  scenario trains with dropout 0.1; eval must not: its metrics equal those of
  the same state evaluated by a dropout-free config.
  """
  losses, rounds, held_out = _eval_run(scenario)
  for after_step, _, before, after in rounds:
    assert_bitwise_equal(before, after, f'train state across the eval after step {after_step}')
  assert [_hex(x) for x in losses[0]] == [_hex(x) for x in losses[1]]
  model_cfg, train_cfg = get_configs('tiny', scenario)
  assert model_cfg.dropout_rate > 0
  _, metrics, before, _ = rounds[-1]
  for side in make_sides(replace(model_cfg, dropout_rate=0.0), train_cfg):
    state = side.from_checkpoint(before[0])
    for i, batch in enumerate(held_out):
      assert_bitwise_equal(
          side.eval_step(state, batch), metrics[i][0], f'{side.name} eval without dropout, batch {i}'
      )
  # Last: the record (its conditions may skip the rest on a host it was not taken for).
  _assert_record_conditions()
  assert [_hex(x) for x in losses[0]] == _golden_losses(scenario)
