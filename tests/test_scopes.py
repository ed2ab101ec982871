"""A declared program difference is confined to its modules.

Flax's stock layer norms lower differently on the two sides (same numbers):
with the operations located in the declared module left out
(`programs.canonicalize(opaque_modules=...)`, the NNX module calls named by
their Linen paths, parity/compare/scopes.py), the rest of the program must be
identical, so an undeclared change elsewhere fails however small it is.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from parity.core import compat
from parity.compare import programs
from parity.compare import scopes

RENAMES = {'norm': 'LayerNorm_0', 'dense': 'Dense_0'}


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.LayerNorm()(x))


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, extra_op: str | None = None):
    self.norm = nnx.LayerNorm(4, rngs=rngs)
    self.dense = nnx.Linear(4, 4, rngs=rngs)
    self.extra_op = extra_op  # 'before' or 'after' the norm: the same numbers, one more operation

  def __call__(self, x):
    if self.extra_op == 'before':
      x = x * 1.0
    y = self.dense(self.norm(x))
    return y * 1.0 if self.extra_op == 'after' else y


X = jnp.ones((2, 4), jnp.float32)


def _linen_text() -> str:
  model = LinenNet()
  params = model.init(jax.random.key(0), X)
  return jax.jit(model.apply).lower(params, X).as_text(debug_info=True)


def _nnx_text(extra_op: str | None = None, named: bool = True) -> str:
  model = NnxNet(nnx.Rngs(0), extra_op)
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  if not named:
    return step.lower(state, X).as_text(debug_info=True)
  with compat.fresh_trace(), scopes.nnx_module_scopes(model, lambda p: RENAMES.get(p, p)):
    return step.lower(state, X).as_text(debug_info=True)


def test_the_stock_layer_norms_differ_only_inside_the_declared_module():
  linen, nnx_ = _linen_text(), _nnx_text()
  assert not programs.diff(linen, nnx_).identical  # the premise: the stock norms lower differently
  d = programs.diff(linen, nnx_, opaque_modules=('LayerNorm_0',))
  assert d.identical, d.diff


def test_a_change_outside_the_declared_module_is_a_difference():
  d = programs.diff(_linen_text(), _nnx_text(extra_op='after'), opaque_modules=('LayerNorm_0',))
  assert not d.identical
  assert 'multiply' in d.diff


def test_a_change_that_only_feeds_the_declared_module_is_a_difference():
  """An operation whose one user is inside the module is still compared.

  The module's operations stand for a value of their inputs from outside it,
  so what computes those inputs is live and must match.
  """
  d = programs.diff(_linen_text(), _nnx_text(extra_op='before'), opaque_modules=('LayerNorm_0',))
  assert not d.identical
  assert 'multiply' in d.diff


def test_unnamed_nnx_modules_confine_nothing():
  d = programs.diff(_linen_text(), _nnx_text(named=False), opaque_modules=('LayerNorm_0',))
  assert not d.identical


def test_nnx_module_calls_carry_their_linen_paths():
  names = set(programs._location_names(_nnx_text()).values())
  modules = {tuple(programs.module_of(n)) for n in names if n}
  assert ('LayerNorm_0',) in modules and ('Dense_0',) in modules


def test_module_of_reads_through_transformations():
  assert programs.module_of('transpose(jvp(Encoder))/layers_0/LayerNorm_0/mul') == ['layers_0', 'LayerNorm_0']
  assert programs.module_of('jvp(Encoder)/Dense_0/dot_general') == ['Dense_0']
  assert programs.module_of('jit(apply)/Net/LayerNorm_0/rsqrt') == ['LayerNorm_0']
  assert programs.module_of('jvp()/add') == []
  # A Linen subclass whose __call__ calls super().__call__ enters the root's scope twice.
  assert programs.module_of('jvp(MyLm)/MyLm/DecoderBlock_0/LayerNorm_0/mul') == ['DecoderBlock_0', 'LayerNorm_0']
  assert programs.module_of('transpose(jvp(MyLm))/MyLm/MyLm/Dense_0/dot_general') == ['Dense_0']


def _text(module_ops: list[str]) -> str:
  """A program: `module_ops` located in module M (results `%0`, `%1`), then `%1 * %1` outside it."""
  return '\n'.join([
      'module @m {',
      '  func.func public @main(%arg0: tensor<4xf32>) -> (tensor<4xf32>) {',
      *[f'    {op} loc(#loc1)' for op in module_ops],
      '    %2 = stablehlo.multiply %1, %1 : tensor<4xf32> loc(#loc2)',
      '    return %2 : tensor<4xf32>',
      '  }',
      '}',
      '#loc1 = loc("Net/M/op")',
      '#loc2 = loc("Net/mul")',
  ])


def test_a_module_computing_otherwise_with_a_multi_result_operation_is_the_same_outside_it():
  """One result of a multi-result operation inside the module (`%0#1`) is not an input from outside."""
  two_results = _text([
      '%0:2 = stablehlo.optimization_barrier %arg0, %arg0 : tensor<4xf32>, tensor<4xf32>',
      '%1 = stablehlo.add %0#0, %0#1 : tensor<4xf32>',
  ])
  one_result = _text(['%0 = stablehlo.abs %arg0 : tensor<4xf32>', '%1 = stablehlo.add %0, %0 : tensor<4xf32>'])
  assert not programs.diff(two_results, one_result).identical
  d = programs.diff(two_results, one_result, opaque_modules=('M',))
  assert d.identical, d.diff


def _scaled(constant: str, op: str, constant_used_outside: bool = False, feed: str = 'negate') -> str:
  """Module M scales `feed(%arg0)` by a constant that jax located at the jit's root, as it locates
  the scale and the mask value of flax's stock attention; outside M, `%1 * %1`, or `%1 * scale`."""
  outside = '%b' if constant_used_outside else '%1'
  return '\n'.join([
      'module @m {',
      '  func.func public @main(%arg0: tensor<4xf32>) -> (tensor<4xf32>) {',
      f'    %x = stablehlo.{feed} %arg0 : tensor<4xf32> loc(#loc0)',
      f'    %c = stablehlo.constant dense<{constant}> : tensor<f32> loc(#loc0)',
      '    %b = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<4xf32> loc(#loc0)',
      f'    %1 = stablehlo.{op} %x, %b : tensor<4xf32> loc(#loc1)',
      f'    %2 = stablehlo.multiply %1, {outside} : tensor<4xf32> loc(#loc2)',
      '    return %2 : tensor<4xf32>',
      '  }',
      '}',
      '#loc0 = loc("jit(f)")',
      '#loc1 = loc("Net/M/op")',
      '#loc2 = loc("Net/mul")',
  ])


def test_a_constant_located_outside_the_declared_module_is_part_of_how_it_computes():
  """Linen's stock attention divides by 8.0 where NNX's multiplies by 0.353553385, each constant
  located at the jit's root: with the module declared, the programs are identical outside it.
  A constant that a user outside the module reads too is compared there."""
  linen, nnx_ = _scaled('8.000000e+00', 'divide'), _scaled('0.353553385', 'multiply')
  assert not programs.diff(linen, nnx_).identical
  d = programs.diff(linen, nnx_, opaque_modules=('M',))
  assert d.identical, d.diff
  shared = programs.diff(_scaled('8.000000e+00', 'divide', constant_used_outside=True),
                         _scaled('0.353553385', 'multiply', constant_used_outside=True), opaque_modules=('M',))
  assert not shared.identical and '0.353553385' in shared.diff, shared.diff
  # What feeds the module from outside is still compared.
  fed = programs.diff(linen, _scaled('8.000000e+00', 'divide', feed='abs'), opaque_modules=('M',))
  assert not fed.identical and 'abs' in fed.diff, fed.diff


class LinenRemat(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.remat(nn.LayerNorm)(name='LayerNorm_0')(x))


class NnxRemat(NnxNet):
  def __call__(self, x):
    return self.dense(nnx.remat(lambda norm, x: norm(x))(self.norm, x))


def _gradient_texts(linen_model: nn.Module, nnx_model: nnx.Module) -> tuple[str, str]:
  """The gradient of the sum of each model's output, lowered with debug locations; the NNX
  module calls named by their Linen paths (each path component renamed by RENAMES)."""
  def loss(apply):
    return lambda p, x: jnp.sum(apply(p, x))

  params = linen_model.init(jax.random.key(0), X)
  linen = jax.jit(jax.grad(loss(linen_model.apply))).lower(params, X).as_text(debug_info=True)
  graphdef, state = nnx.split(nnx_model)
  step = jax.jit(jax.grad(loss(lambda s, x: nnx.merge(graphdef, s)(x))))
  rename = lambda p: '/'.join(RENAMES.get(c, c) for c in p.split('/'))
  with compat.fresh_trace(), scopes.nnx_module_scopes(nnx_model, rename):
    return linen, step.lower(state, X).as_text(debug_info=True)


def test_a_declared_module_inside_remat_is_confined_on_both_sides():
  """nn.remat and nnx.remat around the stock norm, forward and backward lowered.

  NNX's remat calls a copy of the norm (nnx.merge); the copy carries its
  original's path tag, so its operations are named as the original's. The
  rematerialised backward pass repeats the root and adds jax.checkpoint's own
  name-stack components, which are not modules. With the norm left out, the
  two programs are identical.
  """
  linen, nnx_text = _gradient_texts(LinenRemat(), NnxRemat(nnx.Rngs(0)))
  assert not programs.diff(linen, nnx_text).identical  # the premise: the stock norms differ
  d = programs.diff(linen, nnx_text, opaque_modules=('LayerNorm_0',))
  assert d.identical, d.diff
  assert programs.module_of('jit(f)/transpose(jvp(Net))/jvp(Net)/checkpoint/rematted_computation/'
                            'blocks_0/LayerNorm_0/add') == ['blocks_0', 'LayerNorm_0']


LAYERS = 3


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.Dense(4)(nn.LayerNorm()(x)), None


class LinenStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(LinenBlock, variable_axes={'params': 0}, split_rngs={'params': True}, length=LAYERS)
    return stack(name='layers')(x, None)[0]


class NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(4, rngs=rngs)
    self.dense = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return self.dense(self.norm(x))


class NnxStack(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxBlock(rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return body(x, self.layers)


def test_a_declared_module_inside_a_scanned_stack_is_confined_on_both_sides():
  """nn.scan against nnx.scan over nnx.vmap-made blocks of the stock norm and dense, forward
  and backward lowered.

  nnx.scan calls copies of the blocks (nnx.merge), which carry their
  originals' path tags: their operations are named as Linen names its own
  (`layers/LayerNorm_0/...`: inside a scanned body the name stack starts at the
  stack, with no root), so the norm declared by its path is left out on both
  sides, and what remains is identical. The dense declared instead leaves the
  norms compared: the programs differ.
  """
  linen, nnx_text = _gradient_texts(LinenStack(), NnxStack(nnx.Rngs(0)))

  def body_modules(text):  # the modules of the operations named inside the scanned body
    found = [(programs.module_of(n), programs.module_of(n, keep_first=True))
             for n in programs._location_names(text).values()]
    return {tuple(p) for f in found for p in f if p[:1] == ['layers']}

  assert body_modules(linen) == {('layers', 'LayerNorm_0'), ('layers', 'Dense_0')}
  assert body_modules(nnx_text) == body_modules(linen)
  assert not programs.diff(linen, nnx_text).identical  # the premise: the stock norms differ
  d = programs.diff(linen, nnx_text, opaque_modules=('layers/LayerNorm_0',))
  assert d.identical, d.diff
  assert not programs.diff(linen, nnx_text, opaque_modules=('layers/Dense_0',)).identical
  assert programs.module_of('layers/LayerNorm_0/add', keep_first=True) == ['layers', 'LayerNorm_0']  # jax 0.10
  assert programs.module_of('jit(f)/transpose(jvp(Net))/while/body/eval_jaxpr/layers/LayerNorm_0/add') == [
      'layers', 'LayerNorm_0']  # jax 0.12: the body inlined
  assert programs.module_of('jvp(Net)/while/Dense_0/add') == ['while', 'Dense_0']  # a module named while


def test_where_two_programs_part_is_named():
  """An NNX step that multiplies its input by 1.0 first: every operation after that differs,
  and the first differing line may be any of them (ready statements are ordered by hash).
  Where they part is the one NNX operation of values both compute, the constant 1.0, and
  on the Linen side the operations that read the input the NNX side reads multiplied."""
  d = programs.diff(_linen_text(), _nnx_text('before'))
  assert not d.identical
  assert [line.split(' = ', 1)[1] for line in d.parting_nnx] == ['stablehlo.constant dense<1.000000e+00> : tensor<f32>']
  assert d.parting_linen and all('%a0' in line for line in d.parting_linen), d.parting_linen
  assert d.parting_lines()[-1] == 'where they part, NNX: ' + d.parting_nnx[0]
  same = programs.diff(_linen_text(), _linen_text())
  assert same.identical and same.parting_linen == same.parting_nnx == []
