"""The same program, not only the same numbers: memory and canonical programs per scenario.

For every scenario on one device, and on the 3-axis mesh for the scenarios
the suite trains there (`tests.runs.mesh_cases`; every one with
`--full-mesh-matrix`), XLA's memory analysis of the two compiled train steps (argument, output, temporary,
aliased and peak bytes) is equal to the byte, and the canonical programs are
identical except for the allowed differences (`parity.compare.programs.ALLOWED`,
today only the step counter's dtype). `10_scan_axis0` stores the NNX layers
on another axis on purpose; its programs differ and the report says why.

The numbers come from runs the suite makes anyway (`tests.runs`): nothing
here compiles a step of its own. One combination no scenario trains, fp8
under rematerialisation, is lowered here (not compiled) for its programs.
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from bridge.layout import layout_for
from models import data, rng
from models.config import SCENARIOS, get_configs
from parity.compare import programs
from parity.run import compiling
from parity.run import verdicts
from bridge.sides import make_sides
from tests.runs import THREE_AXES, mesh_cases, mesh_run, tiny_run

SAME_LAYOUT = [s for s in sorted(SCENARIOS) if not layout_for(get_configs('tiny', s)[0]).moves]
ALLOWED = [a.name for a in programs.ALLOWED]


PROGRAM_CASES = SAME_LAYOUT


def pytest_generate_tests(metafunc):
  if metafunc.function.__name__.endswith('_on_the_three_axis_mesh'):
    full = metafunc.config.getoption('--full-mesh-matrix')
    metafunc.parametrize('scenario', [s for s, _ in mesh_cases(full, (THREE_AXES,)) if s in SAME_LAYOUT])


def _check_memory(memory: tuple[dict, dict]) -> None:
  assert all(memory[0].get(f) is not None for f in verdicts.MEMORY_FIELDS), memory[0]
  assert verdicts.memory_drift(*memory) == []


def _check_program(diff: programs.ProgramDiff) -> None:
  assert diff.identical, diff.summary() + '\n' + diff.diff
  assert diff.allowed == ALLOWED


@pytest.mark.parametrize('scenario', SAME_LAYOUT)
def test_memory_equal_on_one_device(scenario):
  result = tiny_run(scenario)
  _check_memory((result.linen.memory, result.nnx.memory))


def test_memory_equal_on_the_three_axis_mesh(scenario):
  _check_memory(mesh_run(scenario, THREE_AXES).memory)


@pytest.mark.parametrize('scenario', PROGRAM_CASES)
def test_program_identical_on_one_device(scenario):
  _check_program(tiny_run(scenario).program_diff)


def test_program_identical_on_the_three_axis_mesh(scenario):
  _check_program(mesh_run(scenario, THREE_AXES).program_diff)


@pytest.mark.exhaustive
def test_the_other_layout_is_a_stated_program_difference():
  """`10_scan_axis0`: the layers' axis differs by design, so the programs do too."""
  result = tiny_run('10_scan_axis0')
  assert layout_for(result.model_cfg).moves
  assert not result.program_diff.identical
  assert 'axis 0' in result.expected_difference and result.same_program
  # Only temporaries may differ: the state the step reads and writes takes the same bytes.
  memory = (result.linen.memory, result.nnx.memory)
  assert all(m.get(f) is not None for m in memory for f in verdicts.MEMORY_FIELDS), memory
  assert verdicts.memory_drift(*memory, exclude=verdicts.LAYOUT_MOVE_MEMORY) == []
  # A state of other bytes would not pass as a layout move.
  grown = dict(result.nnx.memory, argument_bytes=result.nnx.memory['argument_bytes'] + 4)
  moved = dataclasses.replace(result, nnx=dataclasses.replace(result.nnx, memory=grown))
  assert moved.expected_difference is not None and not moved.same_program


@pytest.mark.exhaustive
@pytest.mark.parametrize('scanned', [True, False], ids=['scanned', 'unscanned'])
def test_fp8_under_rematerialisation_is_the_same_program(scanned):
  """fp8 and remat together (no scenario combines them): lowered, not trained.

  Linen's `nn.remat` takes a layer's variables as one dict of collections,
  which jax flattens in key order: the fp8 collection (`_overwrite_with_gradient`)
  before `params`. NNX's `_remat_layer` splits the layer in that order; with
  the state split by path (or parameters first), the unscanned programs
  differ (the scanned backward layer loop then carries its values in another
  order, which is the same program: `programs.loop_order_difference` notes it).
  """
  model_cfg, train_cfg = get_configs('tiny', '05_fp8' if scanned else '02_unscanned')
  model_cfg = dataclasses.replace(model_cfg, quantization='fp8', remat_policy='full')
  batch = data.make_batch(model_cfg, train_cfg, 0)
  lowered = [
      compiling.comparison_lowering(side, jax.eval_shape(lambda: side.init(0)), batch, rng.base_key(0))
      for side in make_sides(model_cfg, train_cfg)
  ]
  (linen_text, linen_args, _), (nnx_text, nnx_args, _) = lowered
  _check_program(programs.diff(
      linen_text, nnx_text, linen_args=linen_args, nnx_args=nnx_args, allowed=programs.ALLOWED,
  ))


def test_an_allowed_difference_is_listed_only_where_a_side_applied_it():
  """The decoder's Linen side traces its step with a uint32 counter (the step counter dtype,
  `programs.ALLOWED`); a side whose `comparison_state` changes nothing applies nothing, and
  its identical programs are then identical with nothing excepted."""
  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  linen, nnx_side = make_sides(model_cfg, train_cfg)
  for side, changed in ((linen, True), (nnx_side, False)):
    own = jax.eval_shape(lambda: side.init(0))
    assert compiling.state_changed(own, side.comparison_state(own)) is changed

  text = 'module @m {\n  func.func public @main(%arg0: tensor<f32>) -> tensor<f32> {\n    return %arg0 : tensor<f32>\n  }\n}'
  def step(applied):
    return compiling.CompiledStep(None, text, 0.0, 0.0, text, ['x'], allowed_applied=applied)
  plain = compiling.program_diff_of(step(False), step(False))
  assert plain.identical and plain.allowed == [] and 'except' not in plain.summary()
  applied = compiling.program_diff_of(step(True), step(False))
  assert applied.allowed == ALLOWED and 'except: step counter dtype' in applied.summary()


def _barrier_program(order: str, real: bool = False) -> str:
  def step(x, y):
    saved = {'sc': (jnp.sin(x), jnp.cos(y)), 'cs': (jnp.cos(y), jnp.tan(x) if real else jnp.sin(x))}[order]
    a, b = jax.lax.optimization_barrier(saved)
    return (a * 2 + b) if order == 'sc' else (b * 2 + a)

  x = jnp.ones(3)
  return jax.jit(step).lower(x, x).as_text(debug_info=True)


def test_operands_of_an_optimization_barrier_in_another_order_are_the_same_program():
  """Rematerialisation saves values behind one barrier in the order its implementation collects
  them (Linen's nn.remat and jax.checkpoint over NNX state differ): the canonical program puts
  the operands in an order of their own, and a real difference behind the barrier still shows."""
  names = dict(linen_args=['x', 'y'], nnx_args=['x', 'y'])
  assert programs.diff(_barrier_program('sc'), _barrier_program('cs'), **names).identical
  assert not programs.diff(_barrier_program('sc'), _barrier_program('cs', real=True), **names).identical


def _cond_program(order: str, factor: float = 2.0) -> str:
  """A jitted lax.cond returning (x * factor, x + 1) on one branch, (x, x - 1) on the other,
  in `order` ('ab' or 'ba'), as two pytrees in other path orders return their leaves."""

  def f(p, x):
    pairs = (lambda x: (x * factor, x + 1.0), lambda x: (x, x - 1.0))
    if order == 'ba':
      b, a = jax.lax.cond(p > 0, *(lambda x, g=g: g(x)[::-1] for g in pairs), x)
    else:
      a, b = jax.lax.cond(p > 0, *pairs, x)
    return a, b

  return jax.jit(f).lower(1, jnp.ones(3)).as_text()


def test_a_conditional_returning_its_values_in_another_order_is_the_same_program():
  """optax's MultiSteps returns the optimizer state through lax.cond in each side's pytree
  order: the canonical program orders a conditional's results by what its branches return,
  and a real difference inside a branch still shows."""
  names = dict(linen_args=['p', 'x'], nnx_args=['p', 'x'])
  assert programs.diff(_cond_program('ab'), _cond_program('ba'), **names).identical
  assert not programs.diff(_cond_program('ab'), _cond_program('ba', factor=3.0), **names).identical


def _scanned_in_a_module(order: str) -> str:
  """A scan inside module `RNN_0` carrying (w, v) in `order` ('ab' or 'ba'), as flax's two RNNs
  carry a cell's parameters in other orders; the rest of the program reads both results."""

  def body(carry, x):
    a, b = carry
    return (a * x, b + x), a

  def swapped(carry, x):
    (a, b), y = body(carry[::-1], x)
    return (b, a), y

  def f(w, v, xs):
    with jax.named_scope('RNN_0'):
      if order == 'ab':
        (a, b), ys = jax.lax.scan(body, (w, v), xs)
      else:
        (b, a), ys = jax.lax.scan(swapped, (v, w), xs)
    return a.sum() + b.sum(), ys

  return jax.jit(f).lower(jnp.ones(3), jnp.ones((2, 3)), jnp.ones((4, 3))).as_text(debug_info=True)


def test_a_loop_inside_a_declared_module_is_that_modules_own():
  """Undeclared, a loop carrying the same values in another order is the same program, its order
  noted; with its module left out, its results are matched by type and initial value, its order
  is the module's own (not noted) and the programs are the same."""
  names = dict(linen_args=['w', 'v', 'xs'], nnx_args=['w', 'v', 'xs'])
  linen, nnx_ = _scanned_in_a_module('ab'), _scanned_in_a_module('ba')
  undeclared = programs.diff(linen, nnx_, **names)
  assert undeclared.identical and 'carries the same 5 values in another order' in undeclared.loop_order
  declared = programs.diff(linen, nnx_, **names, opaque_modules=('RNN_0',))
  assert declared.identical and declared.loop_order == ''


def test_where_the_programs_part_shows_an_attribute_far_along_its_line():
  """A convolution dilated otherwise: the operation's line is long and its value names (hashes of
  what it computes) differ from the first characters, so the lines where the programs part are
  shown from where the operation itself differs, the dilation, not cut before it."""
  def program(dilation):
    def f(x, w):
      return jax.lax.conv_general_dilated(x, w, (1, 1), 'SAME', rhs_dilation=(dilation, dilation))
    return jax.jit(f).lower(jnp.ones((1, 3, 16, 16)), jnp.ones((4, 3, 3, 3))).as_text()

  d = programs.diff(program(1), program(2), linen_args=['x', 'w'], nnx_args=['x', 'w'])
  assert not d.identical
  assert any('rhs_dilate = [1, 1]' in line for line in d.parting_linen), d.parting_linen
  assert any('rhs_dilate = [2, 2]' in line for line in d.parting_nnx), d.parting_nnx
