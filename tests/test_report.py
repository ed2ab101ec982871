"""`parity compare` as a report: timing done right, FLOPs, program diff, tables, progress.

The equivalence checks here are bitwise (parity.core.bitwise) with no tolerance.
The timing and FLOPs checks are not equivalence checks: each states the
bound it asserts and why.
"""
import dataclasses
import difflib
import io
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from models import data, rng
from models.config import get_configs
from parity.store import checkpoints
from bridge import flops
from parity.compare import programs
from parity.run import report
from parity.run import compiling
from parity.run import runner
from parity.run import verdicts
from bridge import reference
from bridge.sides import as_jax_batch
from tests.runs import STEPS, tiny_run

TIMING_STEPS = 12
CHECKPOINT_EVERY = 3


# ---------------------------------------------------------------------------
# Timing (how steps are timed: parity/run/runner.py)
# ---------------------------------------------------------------------------


def test_step_times_and_checkpoint_saves_are_timed_apart(tmp_path):
  """12 steps, an Orbax save of both states every 3 steps.

  Bounds: no step is faster than a tenth of the median step (the seed's
  0.007 s steps were dispatch times, two orders below its real steps). A
  busy 2-core machine spreads correctly timed steps over 7-40 ms, so the
  earlier half-the-median bound failed now and then. On XLA:CPU this tiny
  step runs within the call, so a clock stopped before the host sync gives
  nearly the same times (tried: it passes); the bound is for accelerators,
  where the call returns at dispatch. The steps right after
  a save are not a step plus a save (the seed's 9.285 s step held one):
  their median stays below the median step plus half the median save.
  Structural, exact: no save overlaps any timed step, every save starts
  after that step's losses are on the host, and each save is in the files.
  """
  events = []
  saver = runner.OrbaxSaver(str(tmp_path), rng.base_key(0))

  def checkpoint_fn(side, step, state):
    events.append(('save', side.name, step))
    saver(side, step, state)

  def on_step(step, linen_run, nnx_run):
    assert len(linen_run.losses) == len(nnx_run.losses) == step + 1
    events.append(('losses on host', step))

  result = reference.run_compare(
      *get_configs('tiny'), steps=TIMING_STEPS, on_step=on_step,
      checkpoint_every=CHECKPOINT_EVERY, checkpoint_fn=checkpoint_fn, program_diff=False,
  )
  saver.close()
  assert result.bitwise_equal, result.verdict()
  saved_after = list(range(CHECKPOINT_EVERY - 1, TIMING_STEPS, CHECKPOINT_EVERY))

  for run in (result.linen, result.nnx):
    assert len(run.step_times) == TIMING_STEPS  # step 0 included
    assert run.compile_s is not None and run.compile_s > 0
    median = statistics.median(run.step_times)
    assert min(run.step_times) >= 0.1 * median, run.step_times
    assert run.checkpoint_steps == saved_after
    assert len(run.checkpoint_s) == len(saved_after)
    after_save = [run.step_times[s + 1] for s in saved_after if s + 1 < TIMING_STEPS]
    assert statistics.median(after_save) < median + 0.5 * statistics.median(run.checkpoint_s), (
        run.step_times, run.checkpoint_s)

  step_spans = result.linen.step_spans + result.nnx.step_spans
  save_spans = result.linen.checkpoint_spans + result.nnx.checkpoint_spans
  for save_start, save_end in save_spans:
    for step_start, step_end in step_spans:
      assert step_end <= save_start or save_end <= step_start, 'a save inside a timed step'
  for name, step in [(e[1], e[2]) for e in events if e[0] == 'save']:
    assert events.index(('losses on host', step)) < events.index(('save', name, step))
  for name in verdicts.SIDES:
    manager = checkpoints.open_manager(tmp_path / name, create=False)
    assert sorted(manager.all_steps()) == saved_after
    manager.close()


@pytest.mark.exhaustive
def test_avg_step_leaves_step_0_out_and_per_device_rates_follow():
  result = tiny_run()
  run = result.linen
  assert run.avg_step_s == float(np.mean(run.step_times[1:]))
  tokens = result.train_cfg.batch_size * result.train_cfg.seq_len
  assert result.tokens_per_s('linen') == tokens / run.avg_step_s / result.num_devices
  assert result.tflops_per_s('linen') == result.flops.total / run.avg_step_s / 1e12


# ---------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------


def test_weight_flops_match_a_reference_training_log():
  """A reference training log of the `default` model: 11.338 TFLOP/s/device at 1812.1 tokens/s/device, 99.60% weight FLOPs.

  So 6.2568e9 FLOPs per token, 6.2318e9 of them weight FLOPs, for the
  `default` model. The printout rounds to 5 significant digits (and 0.01%),
  hence the 1e-3 relative bound.
  """
  model_cfg, _ = get_configs('default')
  per_token = 2 * flops.TRAIN_MULTIPLIER * flops.weight_macs_per_token(model_cfg)
  seed_weight_flops = 11.338e12 / 1812.1 * 0.9960
  assert abs(per_token / seed_weight_flops - 1) < 1e-3, per_token


@pytest.mark.exhaustive
def test_analytic_flops_agree_with_xla_cost_analysis():
  """The analytic count against XLA's cost analysis of the compiled Linen step.

  `02_unscanned`: XLA counts a while loop's body once, so the scanned
  program would show one layer. XLA counts every elementwise operation too
  (norms, RoPE, softmax, loss, AdamW), which the analytic count leaves out:
  on `tiny` that is 7-9% on top (jax 0.10: 8.4%, jax 0.12: 7.2%), so XLA must
  land between 1.0x and 1.15x of the analytic count. A missing matmul (the
  smallest, one layer's key projection, is 3% of the total) or a wrong
  factor (forward-only would be 1/3) falls outside.
  """
  model_cfg, train_cfg = get_configs('tiny', '02_unscanned')
  # The runner's sides: a run of this scenario elsewhere in the session
  # has compiled this step already.
  linen, _ = reference.sides_for(model_cfg, train_cfg, None)
  state = linen.init(0)
  batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, 0))
  xla = compiling.compile_step(linen, state, batch, rng.base_key(0), compare_program=False).cost_flops()
  analytic = flops.train_step_flops(model_cfg, train_cfg)
  assert analytic.weights > 0 and analytic.attention > 0
  assert 1.0 <= xla / analytic.total <= 1.15, (xla, analytic.total)


@pytest.mark.exhaustive
def test_a_step_compiled_without_its_comparison_has_no_program_to_diff():
  """`compare_program=False` skips the comparison lowering; diffing such a step is an error."""
  model_cfg, train_cfg = get_configs('tiny', '02_unscanned')
  linen, _ = reference.sides_for(model_cfg, train_cfg, None)
  batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, 0))
  step = compiling.compile_step(linen, linen.init(0), batch, rng.base_key(0), compare_program=False)
  assert step.compared_text is None and step.argument_names is None
  with pytest.raises(ValueError, match='compare_program=True'):
    compiling.program_diff_of(step, step)


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def test_memory_analysis_of_both_compiled_steps():
  result = tiny_run()
  for run in (result.linen, result.nnx):
    memory = run.memory
    assert memory['argument_bytes'] > 0 and memory['output_bytes'] > 0
    assert memory['peak_bytes'] == (
        memory['argument_bytes'] + memory['output_bytes'] + memory['temp_bytes']
        - memory['alias_bytes']
    )
    # The arguments hold at least the parameters and both Adam moments (f32).
    assert memory['argument_bytes'] >= 3 * 4 * result.param_count
  # The CPU reports no memory limit: no percentage is made up.
  if jax.devices()[0].platform == 'cpu':
    assert result.linen.memory['percent'] is None


# ---------------------------------------------------------------------------
# Program diff
# ---------------------------------------------------------------------------


def _texts():
  texts = tiny_run().program_texts
  return texts['linen'], texts['nnx']


def test_canonical_form_ignores_names_order_and_dead_code():
  linen, _ = _texts()
  # Rename every SSA value and private function, and add a dead operation.
  renamed = linen.replace('%cst', '%renamed_cst').replace('@_where', '@where_renamed')
  lines = renamed.splitlines()
  body = next(i for i, l in enumerate(lines) if 'func.func public @main' in l) + 1
  lines.insert(body, '    %dead = stablehlo.constant dense<7.0> : tensor<f32>')
  assert programs.diff(linen, '\n'.join(lines)).identical


def test_a_long_diff_is_cut_line_by_line_with_a_changed_pair_cut_around_its_difference():
  """Of a run of removed lines beside fewer added ones, the last removed lines pair with the added
  ones, each pair cut around where it differs; the rest are cut on their own. Linear in the diff:
  a diff of thousands of lines (a program that differs everywhere) is cut at once."""
  a, b = 'x' * 200 + 'A' + 'y' * 20, 'x' * 200 + 'B' + 'y' * 20
  lines = ['@@ -1 +1 @@', '-' + 'z' * 300, '-' + a, '+' + b, ' context']
  cut = programs._clip_diff(lines, 40)
  assert cut[:2] == ['@@ -1 +1 @@', programs._clip('-' + 'z' * 300, 40)]
  assert 'A' in cut[2] and 'B' in cut[3], cut  # each cut around where the pair differs
  assert cut[2][0] == '-' and cut[3][0] == '+' and len(cut[2]) <= 40 and cut[4] == ' context', cut
  # More added lines than removed: none paired, each cut on its own.
  assert programs._clip_diff(['-' + a, '+' + b, '+' + b], 40) == [programs._clip(line, 40) for line in
                                                                   ('-' + a, '+' + b, '+' + b)]
  many = ['-%x = op' + str(i) for i in range(20000)] + ['+%y = op']
  started = time.perf_counter()
  assert len(programs._clip_diff(many, 160)) == len(many)
  assert time.perf_counter() - started < 5, 'cut in time quadratic in the diff'


def test_program_diff_finds_a_changed_constant():
  linen, _ = _texts()
  changed = linen.replace('dense<1.000000e+04>', 'dense<2.000000e+04>', 1)
  assert changed != linen, 'the RoPE max timescale is not in the program'
  d = programs.diff(linen, changed)
  assert not d.identical
  assert d.changed_lines > 0
  assert 'dense<2.000000e+04>' in d.diff
  assert d.first_difference is not None and d.first_difference >= 1


def test_program_diff_of_the_baseline():
  """The two baseline programs, as compiled, differ in nothing but the step counter.

  Once names, operation order, argument, result and loop-carry order, dead
  code and transposes that undo each other are read away, what is left is
  the one real difference: Linen's TrainState counts steps in int32,
  `nnx.Optimizer` in uint32 (`%step + 1 : tensor<ui32>`). Every changed line
  is @main's signature, its return, or an integer scalar operation.
  """
  assert tiny_run().program_diff.identical  # the step counter's dtype read away (programs.ALLOWED)
  d = programs.diff(*_texts())  # as compiled: the counters differ
  assert not d.identical
  linen, nnx = (programs.canonicalize(t).splitlines() for t in _texts())
  changed = [
      line.strip()
      for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, linen, nnx, autojunk=False).get_opcodes()
      if tag != 'equal'
      for line in linen[i1:i2] + nnx[j1:j2]
  ]
  assert len(changed) == d.changed_lines
  for line in changed:
    assert (line.startswith(('func.func public @main(', 'return '))
            or re.search(r': tensor<u?i32>$', line)), line
  assert any(re.fullmatch(r'%\w+ = stablehlo\.add %a\d+, %\w+ : tensor<ui32>', l) for l in changed)
  assert any(re.fullmatch(r'%\w+ = stablehlo\.add %a\d+, %\w+ : tensor<i32>', l) for l in changed)


_MODULE = """module @jit_f {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %0:2 = call @g(%arg0, %arg1) : (tensor<4xf32>, tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>)
    return %0#0, %0#1 : tensor<4xf32>, tensor<4xf32>
  }
  func.func private @g(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4xf32>
    %1 = stablehlo.subtract %arg0, %arg1 : tensor<4xf32>
    return %0, %1 : tensor<4xf32>, tensor<4xf32>
  }
}
"""

# The same computation with the callee's arguments and results swapped.
_PERMUTED = """module @jit_g {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %0:2 = call @h_7(%arg1, %arg0) : (tensor<4xf32>, tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>)
    return %0#1, %0#0 : tensor<4xf32>, tensor<4xf32>
  }
  func.func private @h_7(%x: tensor<4xf32>, %y: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %a = stablehlo.subtract %y, %x : tensor<4xf32>
    %b = stablehlo.multiply %y, %x : tensor<4xf32>
    return %a, %b : tensor<4xf32>, tensor<4xf32>
  }
}
"""


def test_argument_and_result_order_of_a_call_does_not_matter():
  assert programs.diff(_MODULE, _PERMUTED).identical
  swapped_operands = _PERMUTED.replace('subtract %y, %x', 'subtract %x, %y')
  d = programs.diff(_MODULE, swapped_operands)
  assert not d.identical and 'stablehlo.subtract' in d.diff


def _loop(swap: bool, factor: float = 2.0):
  """A while loop whose body scatters (an op with a region of its own), carry order per `swap`."""
  import jax

  def body(carry):
    i, x, y = carry
    a, b = (y, x) if swap else (x, y)
    a, b = a.at[i].set(b[i]), b * factor
    return (i + 1, b, a) if swap else (i + 1, a, b)

  def f(a, b):
    init = (0, b, a) if swap else (0, a, b)
    _, x, y = jax.lax.while_loop(lambda c: c[0] < 3, body, init)
    return (y, x) if swap else (x, y)

  x = jax.ShapeDtypeStruct((4,), 'float32')
  return jax.jit(f).lower(x, x).as_text()


def test_loop_carry_order_does_not_matter_with_regions_in_the_body():
  """The order is read through ops with regions nested in the body (fp8's amax scatter on jax 0.12)."""
  straight, swapped = _loop(False), _loop(True)
  names = dict(linen_args=['a', 'b'], nnx_args=['a', 'b'])
  assert '^bb0' in straight and straight != swapped
  assert programs.diff(straight, swapped, **names).identical
  assert not programs.diff(straight, _loop(True, factor=3.0), **names).identical


def _typed_loop(counter_first: bool) -> str:
  """A loop carrying a float vector and an integer counter, in either order."""
  import jax

  def f(x):
    def body(carry):
      if counter_first:
        i, n, v = carry
      else:
        i, v, n = carry
      v, n = v * 2.0, n + 1
      return (i + 1, n, v) if counter_first else (i + 1, v, n)

    init = (0, jnp.int32(0), x) if counter_first else (0, x, jnp.int32(0))
    out = jax.lax.while_loop(lambda c: c[0] < 3, body, init)
    return (out[2], out[1]) if counter_first else (out[1], out[2])

  return jax.jit(f).lower(jax.ShapeDtypeStruct((4,), 'float32')).as_text()


def test_a_loop_carrying_its_values_in_another_order_is_the_same_program_and_noted():
  """The canonical form reads a loop's carry order away, and so does `diff`: the same program.

  The order is noted, not a difference: XLA:GPU scheduled the decoder's fp8
  layer loop otherwise when NNX carried the layers' state interleaved by path
  and Linen one collection after the other (+32 KiB of temporaries on an
  H100, the numbers bitwise equal), which the memory part measures.
  """
  straight, other = _typed_loop(False), _typed_loop(True)
  assert programs.canonicalize(straight) == programs.canonicalize(other)
  same = programs.diff(straight, straight)
  assert same.identical and same.loop_order == ''
  d = programs.diff(straight, other)
  assert d.identical and d.changed_lines == 0 and d.first_difference is None
  assert 'loop 0 (of 1, in program order) carries the same 3 values in another order, from value 1 on' in d.loop_order
  assert d.summary().startswith('programs identical (')
  assert programs.loop_carries(straight) == [['tensor<i32>', 'tensor<4xf32>', 'tensor<i32>']]


def _two_loops(x_first: bool, x_counter_first: bool = False, scaled: bool = False) -> str:
  """Two loops, over a 4-vector `x` and an 8-vector `y`, lowered in either order
  (`scaled`: the first output times 3 after its loop, another program besides)."""
  import jax

  def loop(v, counter_first=False):
    if counter_first:
      return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, v))[1]
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2.0, c[1] + 1), (v, 0))[0]

  def f(x, y):
    if x_first:
      a = loop(x, x_counter_first)
      return (a * 3.0 if scaled else a), loop(y)
    b = loop(y)
    a = loop(x, x_counter_first)
    return (a * 3.0 if scaled else a), b

  return jax.jit(f).lower(jax.ShapeDtypeStruct((4,), 'float32'), jax.ShapeDtypeStruct((8,), 'float32')).as_text()


def test_a_loop_carried_in_another_order_is_no_part_of_a_difference_elsewhere():
  """An nnx.scan splitting its state by path, in a stack whose norms also lower differently:
  the programs differ by the same lines as with the loop in Linen's order, and the summary
  says nothing of the loop (its order is no difference)."""
  reordered = programs.diff(_two_loops(True), _two_loops(False, x_counter_first=True, scaled=True))
  plain = programs.diff(_two_loops(True), _two_loops(False, scaled=True))
  assert not reordered.identical and reordered.changed_lines == plain.changed_lines > 0
  assert reordered.diff == plain.diff and 'another order' not in reordered.summary()
  assert reordered.loop_order == plain.loop_order == ''


def _stacked_step(remat_module: bool) -> tuple[str, list[str]]:
  """An NNX train-like step over 2 stacked blocks in `nnx.scan`, each rematerialised: with
  `nnx.remat` over the module, or with `jax.checkpoint` over its split state (the decoder's
  way, `models/nnx/decoder._remat_layer`); the step reads the parameters after the forward
  pass, as an optimizer does. Returns the lowered program and its argument names."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return x + jnp.tanh(self.lin(x))

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(rngs)

  def body(x, block):
    if remat_module:
      return nnx.remat(lambda b, x: b(x))(block, x)
    graphdef, state = nnx.split(block)
    return jax.checkpoint(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)

  graphdef, state = nnx.split(make(nnx.Rngs(0)))

  def step(state, x):
    model = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, m).sum())(model)
    return jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads)

  names = [f'params/blocks/{i}' for i in range(len(jax.tree.leaves(state)))] + ['x']
  return jax.jit(step).lower(state, jnp.ones((3, 4))).as_text(), names


def test_a_loop_carrying_a_modules_state_back_out_of_nnx_remat_is_named_with_its_fix():
  """`nnx.remat` over a scanned module returns the module's state, so the forward loop carries
  each stacked parameter out again (+8.7 kB of temporaries in a user's stack, measured): the
  summary names the loop, the values only NNX carries and the fix. The Linen role is played
  by the same NNX code with `jax.checkpoint` over the split state, whose loops carry what
  Linen's `nn.remat` loops do."""
  (split, split_names), (module, module_names) = _stacked_step(False), _stacked_step(True)
  grown = programs.loop_carry_growth(split, module, split_names, module_names)
  assert grown.startswith("NNX's loop 0 carries 2 values more than Linen's loop 0 (of 2, in program order):"
                          ' tensor<2x4xf32>, tensor<2x4x4xf32>, each of a parameter\'s type'), grown
  assert '`nnx.remat` over a module returns it' in grown
  d = programs.diff(split, module, linen_args=split_names, nnx_args=module_names)
  assert not d.identical and d.loop_growth == grown and grown in d.summary()
  # @main's signature differs too (its results in their values' canonical order); the first
  # difference named is the first in a body, here the loop.
  canonical = programs.canonicalize(split, split_names).splitlines()
  assert canonical[1].lstrip().startswith('func.func public @main(') and d.first_difference > 2
  assert 'stablehlo.while' in canonical[d.first_difference - 1]
  assert grown not in d.summary(loop_growth=False)
  assert programs.loop_carry_growth(split, split, split_names, split_names) == ''
  # The other way round: Linen carries more, and nothing is said about nnx.remat.
  reverse = programs.loop_carry_growth(module, split, module_names, split_names)
  assert reverse.startswith("Linen's loop 0 carries 2 values more than NNX's loop 0") and 'remat' not in reverse
  # Without argument names, what the extra values are is not known: no cause is named.
  assert 'remat' not in programs.loop_carry_growth(split, module)


def test_loops_are_paired_by_what_they_carry_not_by_their_place_in_the_text():
  """The same loops printed in another order are no difference; a loop carrying its values otherwise still is."""
  x_first, y_first = _two_loops(True), _two_loops(False)
  assert programs.loop_carries(x_first) == programs.loop_carries(y_first)[::-1] != programs.loop_carries(y_first)
  assert programs.loop_order_difference(x_first, y_first) == ''
  swapped = _two_loops(False, x_counter_first=True)
  assert programs.loop_order_difference(x_first, swapped).startswith(
      "Linen's loop 0 and NNX's loop 1 (of 2, in program order) carry the same 2 values in another order, from value 0 on"
  )


# ---------------------------------------------------------------------------
# Tables and progress
# ---------------------------------------------------------------------------

SUMMARY_LABELS = (
    'Parameters', 'Final loss', 'Train metrics, bit for bit', 'TFLOP/s per device',
    'Tokens/s per device', 'Avg s/step', 'Compile s', 'Memory per device: arguments',
    'Memory per device: outputs', 'Memory per device: temporaries', 'Memory per device: peak',
    'Memory %', 'Train-step program', 'JAX', 'Flax', 'Optax', 'Orbax', 'Devices',
)


def test_text_and_markdown_hold_both_tables_and_the_verdict():
  rep = report.Report(tiny_run(), 'tiny', '01_baseline')
  labels = [row[0] for row in rep.summary_rows()]
  for label in SUMMARY_LABELS:
    assert any(l.startswith(label) for l in labels), label
  assert rep.summary_rows()[0][1] == f'{tiny_run().param_count:,} (106.816 thousand)'
  text = rep.text()
  assert 'Diff (NNX − Linen)' in text
  assert re.search(r'^step +Linen loss +NNX loss +equal bits +Linen s +NNX s$', text, re.M)
  assert text.rstrip().endswith('verdict: ' + tiny_run().verdict())
  step_rows = rep.step_rows()
  assert [r[3] for r in step_rows] == ['yes'] * STEPS
  md = rep.markdown().splitlines()
  assert '| Metric | Linen | NNX | Diff (NNX − Linen) |' in md
  assert '| step | Linen loss | NNX loss | equal bits | Linen s | NNX s |' in md
  assert sum(l.startswith('| ') for l in md) == len(rep.summary_rows()) + 1 + STEPS + 1


def test_diff_column_marks_better_and_worse():
  assert report._diff(2.0, 2.0, report.LOWER_IS_BETTER) == '0'
  assert report._diff(2.0, 3.0, report.LOWER_IS_BETTER).endswith('(+50.0%) worse')
  assert report._diff(2.0, 1.0, report.LOWER_IS_BETTER).endswith('(-50.0%) better')
  assert report._diff(2.0, 3.0, report.HIGHER_IS_BETTER).endswith('better')
  assert report._diff(None, 3.0, report.HIGHER_IS_BETTER) == '—'
  assert report._diff(2.0, 1.0, None).endswith('(-50.0%) differs')


def test_a_final_loss_that_differs_is_not_called_better():
  """A lower NNX loss is a divergence (e.g. a causal mask that lets a token see the next),
  not an improvement: the row says it differs."""
  losses = {'linen': [4.5, 4.25], 'nnx': [4.5, 4.0]}
  linen, nnx_run = (verdicts.SideRun(losses=v, loss_hex=[verdicts.loss_hex(x) for x in v]) for v in losses.values())
  diverged = verdicts.CompareResult(2, 'linen', linen, nnx_run, 1, [])
  row = dict((r[0], r[1:]) for r in report.Report(diverged, 'pair x', '-', None).summary_rows())['Final loss']
  assert row[2] == '-2.500e-01 (-5.9%) differs', row


class _Stream(io.StringIO):
  def __init__(self, tty):
    super().__init__()
    self._tty = tty

  def isatty(self):
    return self._tty


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise():
  result = tiny_run()
  for tty in (True, False):
    stream = _Stream(tty)
    progress = report.Progress(2, stream)
    progress.phase('compiling')
    for step in range(2):
      linen = verdicts.SideRun(result.linen.losses[:step + 1], result.linen.loss_hex[:step + 1],
                             result.linen.step_times[:step + 1])
      progress.step(step, linen, linen)
    out = stream.getvalue()
    if tty:
      assert '\r' in out and '[' + '#' * 30 + '] step 2/2' in out
    else:
      assert '\r' not in out
      assert out.splitlines() == [
          'compiling ...',
          f'step 0 (1/2): Linen {report._seconds(linen.step_times[0])} s,'
          f' NNX {report._seconds(linen.step_times[0])} s, losses equal',
          f'step 1 (2/2): Linen {report._seconds(linen.step_times[1])} s,'
          f' NNX {report._seconds(linen.step_times[1])} s, losses equal',
      ]


MEMORY = dict(argument_bytes=100, output_bytes=100, temp_bytes=10, alias_bytes=0, peak_bytes=210)


def _declared_run(passes=('program',), changed=4, outside_identical=True, nnx_memory=None,
                  diff='-a\n+b', max_temp_bytes=0):
  """A 3-step comparison whose programs differ by `changed` canonical lines, with a declared
  program difference (bound 10 lines) on `passes`; Linen's memory is MEMORY."""
  from parity.pairs.adapter import KnownDifference

  declared = KnownDifference(('BatchNorm_0',), passes, 'lowers differently', max_changed_lines=10,
                             max_temp_bytes=max_temp_bytes)
  return verdicts.CompareResult(
      3, 'linen', verdicts.SideRun(memory=dict(MEMORY)), verdicts.SideRun(memory=dict(nnx_memory or MEMORY)),
      None, [],
      declared_program_difference=declared,
      program_diff=programs.ProgramDiff(False, 1, 10, 10, changed, diff),
      program_diff_outside=programs.ProgramDiff(
          outside_identical, None, 8, 8, 0 if outside_identical else 2, ''),
  )


def test_a_declared_program_difference_does_not_excuse_a_memory_difference():
  """Within its declared bound and identical outside its modules, a program difference is
  by design; memory is not part of the declaration, and must still be equal to the byte."""
  result = _declared_run()
  assert result.expected_difference is not None and result.same_program
  grown = dict(MEMORY, argument_bytes=4100, peak_bytes=4210)
  moved = dataclasses.replace(result, nnx=dataclasses.replace(result.nnx, memory=grown))
  assert moved.expected_difference is not None and not moved.same_program


def test_where_programs_part_outside_a_declared_difference_is_what_the_report_shows():
  """With a declared program difference, the lines shown are where the programs part
  outside the declared modules, not inside them (which is declared)."""
  result = _declared_run(outside_identical=False)
  result = dataclasses.replace(
      result,
      program_diff=dataclasses.replace(result.program_diff, parting_linen=['inside the norm']),
      program_diff_outside=dataclasses.replace(result.program_diff_outside, parting_nnx=['the constraint NNX lacks']))
  lines = report.Report(result, 'pair x', '-', None).program_lines()
  assert lines[1].startswith('  outside the declared modules: programs differ'), lines
  assert '  where they part, NNX: the constraint NNX lacks' in lines
  assert not any('inside the norm' in line for line in lines)
  declared_only = _declared_run()
  assert not any('outside the declared' in line for line in report.Report(declared_only, 'pair x', '-', None).program_lines())


def test_the_average_and_the_median_step_leave_the_first_step_out():
  """Step 0 carries first-run effects (the run's first execution, a resume's restore):
  both summaries leave it out, as the report's note says."""
  run = verdicts.SideRun(step_times=[9.0, 1.0, 2.0, 6.0])
  assert (run.avg_step_s, run.median_step_s) == (3.0, 2.0)
  one = verdicts.SideRun(step_times=[9.0])
  assert (one.avg_step_s, one.median_step_s) == (9.0, 9.0)


def test_a_resumed_run_is_titled_by_the_steps_it_ran():
  """`--steps 6 --resume-from` a checkpoint of step 3 runs steps 4 and 5: the title and the
  verdict say so, not 6 steps from an init."""
  resumed = dataclasses.replace(_declared_run(changed=0), steps=6, first_step=4, program_diff=None,
                                declared_program_difference=None)
  r = report.Report(resumed, 'pair x', '-', None)
  assert r.title() == ('Linen vs NNX: pair x, steps 4 to 5 (2), resumed from a checkpoint of step 3,'
                       ' seed 0, one device, no mesh')
  assert resumed.verdict().startswith('bit-identical (2 steps:')
  fresh = dataclasses.replace(resumed, first_step=0)
  assert report.Report(fresh, 'pair x', '-', None).title().endswith('6 steps, seed 0, one device, no mesh;'
                                                                    ' linen initialises')
  assert fresh.verdict().startswith('bit-identical (6 steps:')


@pytest.mark.parametrize('changed', [4, 12], ids=['admitted', 'over_the_bound'])
def test_the_text_report_prints_the_program_diff_unless_a_declaration_admits_it(changed):
  """An admitted difference is a summary line (the diff stays in --json and --markdown);
  one the declaration does not admit is printed in full."""
  r = report.Report(_declared_run(changed=changed, diff='-a line of the diff\n+b'), 'pair x', '-', None)
  printed = '-a line of the diff' in r.text()
  assert printed is (changed > 10)
  assert ("4 changed lines; the diff's first lines are in the --json and --markdown outputs" in r.text()) is (changed <= 10)
  assert '-a line of the diff' in r.markdown()


@pytest.mark.parametrize('where,said', [
    (dict(layer=1, iteration=None), 'first divergent module: layers/mlp, layer 1, forward pass'),
    (dict(layer=None, iteration=3), 'first divergent module: layers/mlp, iteration 3 of its loop, forward pass'),
    (dict(layer=None, iteration=None), 'first divergent module: layers/mlp, forward pass'),
], ids=['a_stacks_layer', 'a_loops_iteration', 'neither'])
def test_the_localizer_line_calls_a_stacks_index_a_layer_and_a_loops_an_iteration(where, said):
  """A scan over layers slices their parameters by its index; an RNN's loop over time steps
  slices none, and its index is no layer."""
  first = dict(step=0, path='layers/mlp', max_ulp=2, **where) | {'pass': 'forward'}
  result = dataclasses.replace(_declared_run(), first_divergent_step=0, first_divergent_module=first,
                               localizer=['forward pass: ...'])
  assert said + ', max 2 ULP' in report.Report(result, 'pair x', '-', None).text()


@pytest.mark.parametrize('nnx_change,admitted', [
    (dict(temp_bytes=74, peak_bytes=274), True),  # +64 B of temporaries: the bound
    (dict(temp_bytes=-54, peak_bytes=146), True),  # -64 B
    (dict(temp_bytes=75, peak_bytes=275), False),  # one byte over
    (dict(argument_bytes=104, temp_bytes=6, peak_bytes=210), False),  # the state's bytes moved
], ids=['plus_the_bound', 'minus_the_bound', 'over_the_bound', 'arguments_differ'])
def test_a_declared_memory_difference_admits_temporaries_within_its_bound(nnx_change, admitted):
  """Declared beside 'program', 'memory' lets temporaries (and so the peak) differ by at most
  `max_temp_bytes` each; arguments, outputs and aliased bytes stay equal to the byte."""
  result = _declared_run(('program', 'memory'), nnx_memory=dict(MEMORY, **nnx_change), max_temp_bytes=64)
  declared = result.declared_program_difference
  assert verdicts.declared_memory_admits(declared, MEMORY, result.nnx.memory) is admitted
  assert result.same_program is admitted
  assert result.memory_verdict.startswith('differs within the declared bound' if admitted else 'differs (NNX')
  # The same numbers without 'memory' in the declaration: not admitted.
  program_only = dataclasses.replace(declared, passes=('program',))
  assert not verdicts.declared_memory_admits(program_only, MEMORY, result.nnx.memory)
  assert not dataclasses.replace(result, declared_program_difference=program_only).same_program
  # By platform: the bound holds where it is named, and declares nothing elsewhere.
  by_platform = dataclasses.replace(declared, max_temp_bytes={'gpu': 64})
  assert verdicts.declared_memory_admits(by_platform, MEMORY, result.nnx.memory, 'gpu') is admitted
  assert not verdicts.declared_memory_admits(by_platform, MEMORY, result.nnx.memory, 'cpu')
  assert by_platform.temp_bytes('gpu') == 64 and by_platform.temp_bytes('cpu') is None
  # The comparison's verdict reads the bound of the platform it ran on (the CPU here).
  for bound, holds in (({'cpu': 64}, admitted), ({'gpu': 64}, False)):
    run = dataclasses.replace(result, declared_program_difference=dataclasses.replace(declared, max_temp_bytes=bound))
    assert run.same_program is holds, bound
    assert run.memory_verdict.startswith('differs within the declared bound' if holds else 'differs (NNX'), bound
  # A comparison that ran on another platform than the first device's reads that platform's bound.
  for platform, holds in (('gpu', admitted), ('cpu', False)):
    run = dataclasses.replace(result, platform=platform,
                              declared_program_difference=dataclasses.replace(declared, max_temp_bytes={'gpu': 64}))
    assert run.same_program is holds, platform
    assert run.memory_verdict.startswith('differs within the declared bound' if holds else 'differs (NNX'), platform


@pytest.mark.parametrize('bound,measured,message', [
    ({'cpu': 256, 'gpu': 64}, None, "max_temp_bytes={'cpu': 256, 'gpu': 64}): nothing differs under it on cpu"
                                    " (the memory is the same on both sides): remove 'cpu' from max_temp_bytes"),
    ({'cpu': 256}, None, "max_temp_bytes={'cpu': 256}): nothing differs under it (the memory is the same on both"
                         " sides): remove 'memory' from its passes and max_temp_bytes"),
    ({'cpu': 256, 'gpu': 64}, 10, "max_temp_bytes={'cpu': 256, 'gpu': 64}) is loose: the measured figure is 10 B of"
                                  " temporaries; declare max_temp_bytes={'cpu': 10, 'gpu': 64}"),
    ({'cpu': 40, 'gpu': 64}, 10, ''),  # within 4 times what is measured
    ({'gpu': 64}, 10, ''),  # no bound on the CPU: nothing to judge here
    (256, 10, 'max_temp_bytes=256) is loose: the measured figure is 10 B of temporaries; declare max_temp_bytes=10'),
], ids=['vacuous_here', 'vacuous_everywhere_named', 'loose', 'tight', 'another_platform', 'one_figure_loose'])
def test_a_memory_bound_by_platform_is_judged_on_this_platform_and_the_advice_can_be_taken(bound, measured, message):
  """Vacuous and loose, as for one figure, with advice the declaration accepts (a mapping may not
  be emptied: where it names only this platform, 'memory' goes)."""
  from parity.pairs.adapter import KnownDifference

  known = KnownDifference(('BatchNorm_0',), ('program', 'memory'), 'r', max_temp_bytes=bound)
  said = known.loose_structure('memory', measured, 'cpu')
  assert (message in said) if message else said == '', said


@pytest.mark.parametrize('kwargs,message', [
    (dict(passes=('program', 'bogus')), r"passes \['bogus'\]: not passes the battery knows"),
    (dict(passes=('forwards',)), r"passes \['forwards'\]"),
    (dict(passes='program'), r'passes: a non-empty tuple of strings'),
    (dict(passes=()), r'passes: a non-empty tuple of strings'),
    (dict(paths='LayerNorm_0'), r'paths: a non-empty tuple of strings'),
    (dict(passes=('memory',), max_temp_bytes={'cuda': 64}), r"max_temp_bytes: .* platforms \('cpu', 'gpu', 'tpu'\),"
     r" or of a platform on a mesh .* to bytes, got \{'cuda': 64\}"),
    (dict(passes=('memory',), max_temp_bytes=-64), r'max_temp_bytes: bytes \(an int of at least 0\)'),
    (dict(passes=('memory',), max_temp_bytes=(('cpu', 1), ('cpu', 2))), r'max_temp_bytes: bytes .* got'),
    (dict(passes=('memory',), max_temp_bytes=('cpu', 1)), r'max_temp_bytes: bytes .* got'),
], ids=['unknown', 'misspelt', 'a_string', 'none', 'paths_a_string', 'memory_unknown_platform', 'memory_negative',
        'memory_platform_twice', 'memory_not_pairs'])
def test_a_declaration_the_battery_cannot_apply_is_an_error(kwargs, message):
  """A misspelt pass would otherwise be accepted and never applied."""
  from parity.pairs.adapter import KnownDifference

  args = dict(paths=('LayerNorm_0',), passes=('program',), reason='r') | kwargs
  with pytest.raises(ValueError, match=message):
    KnownDifference(**args)


def _step_declarations():
  from parity.pairs.adapter import KnownDifference
  return (KnownDifference(('RNN_0',), ('memory',), 'its loop', max_temp_bytes=128),
          KnownDifference(('RNN_1',), ('program',), 'another', max_changed_lines=4))


_STEP_DECLARATIONS = _step_declarations()


@pytest.mark.parametrize('kwargs,message', [
    (dict(steps=0), r"steps: a whole number of train steps, 1 or more, got 0"),
    (dict(steps=2.0), r"steps: a whole number .* got 2.0"),
    (dict(meshes='data=8'), r"meshes: a sequence of mesh specs such as \('data=8',\), got 'data=8'"),
    (dict(meshes=('data=8', '')), r"meshes: a sequence of mesh specs"),
    (dict(known_differences=(_STEP_DECLARATIONS)), r"known_differences: 2 declarations of the steps' program or"
     r" memory .* declare them as one KnownDifference"),
], ids=['no_steps', 'steps_a_float', 'meshes_a_string', 'an_empty_mesh', 'two_step_declarations'])
def test_a_pair_the_battery_cannot_run_as_declared_is_an_error(kwargs, message):
  """Zero steps would compare no training and pass; one mesh string would be taken as its characters;
  a second declaration of the steps' program or memory would be left unread."""
  from parity.pairs.adapter import Pair

  with pytest.raises(ValueError, match=r"Pair 'mine' " + message):
    Pair('mine', lambda mesh: None, lambda step, split='train': {}, **kwargs)
  assert Pair('mine', lambda mesh: None, lambda step, split='train': {}, steps=1, meshes=()).steps == 1


class _PartialSide:
  """A user's side with every member of `Side` but those named."""

  def __init__(self, name, without=()):
    from parity.pairs import adapter

    self.name, self.mesh = name, None
    for member in adapter.side_members():
      if member not in ('name', 'mesh') + tuple(without):
        setattr(self, member, lambda *args: None)
    for member in without:
      if member in ('name', 'mesh'):
        delattr(self, member)


@pytest.mark.parametrize('make_sides,message', [
    (lambda mesh: (_PartialSide('linen'), _PartialSide('nnx', without=('comparison_state', 'param_specs'))),
     r"mine: the NNX side \(_PartialSide\) lacks param_specs, comparison_state of parity.pairs.adapter.Side"),
    (lambda mesh: (_PartialSide('linen', without=('mesh',)), _PartialSide('nnx')),
     r'mine: the Linen side \(_PartialSide\) lacks mesh of parity.pairs.adapter.Side'),
    (lambda mesh: _PartialSide('linen'), r'mine: make_sides\(mesh\) returned _PartialSide, not \(linen side, nnx side\)'),
], ids=['two_methods_missing', 'an_attribute_missing', 'one_side'])
def test_a_side_missing_part_of_the_protocol_is_named_before_anything_runs(make_sides, message):
  """A side lacking members of `Side` fails at once naming them all, not as an AttributeError
  from inside whichever check first calls one; `probe`, which only the localizer calls, may
  be left out."""
  from parity.pairs import adapter

  pair = adapter.Pair('mine', make_sides, lambda step, split='train': {})
  with pytest.raises(adapter.SideError, match=message):
    adapter.make_pair_sides(pair, None)
  no_probe = adapter.Pair('mine', lambda mesh: (_PartialSide('linen', ('probe',)), _PartialSide('nnx', ('probe',))),
                          lambda step, split='train': {})
  assert len(adapter.make_pair_sides(no_probe, None)) == 2


def test_step_metrics_that_are_not_what_side_says_are_named():
  from parity.pairs import adapter

  side = _PartialSide('nnx')
  with pytest.raises(adapter.SideError, match=r"mine: the nnx side's eval_step returned float, not a mapping"):
    adapter.checked_metrics('mine', side, 'eval_step', 1.0, need_loss=False)
  with pytest.raises(adapter.SideError, match=r"train_step returned metrics \['accuracy'\] without `loss`"):
    adapter.checked_metrics('mine', side, 'train_step', {'accuracy': 1.0}, need_loss=True)
  assert adapter.checked_metrics('mine', side, 'eval_step', {'accuracy': 1.0}, need_loss=False) == {'accuracy': 1.0}


@pytest.mark.parametrize('changed,outside_identical,why', [
    (12, True, 'over the declared bound of 10 lines'),
    (4, False, 'different outside the declared modules'),
], ids=['over_the_bound', 'outside_the_modules'])
def test_a_declared_program_difference_excuses_only_what_it_declares(changed, outside_identical, why):
  """The runner applies the battery's rule (KnownDifference.admits_program): a program over
  the bound, or different outside the declared modules, is not the same program."""
  result = _declared_run(changed=changed, outside_identical=outside_identical)
  assert result.expected_difference is None, why
  assert not result.same_program, why
