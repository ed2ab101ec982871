"""Loops are equal up to carry order: a loop's carried values in another order are the same program.

Linen's `nn.scan` and a `jax.lax.scan` over `nnx.split` state carry the same
values in another tuple order (a production pair: "loop 1 (of 2) carries the
same 23 values in another order", and no module to declare it on). The
canonical program orders every loop's carried values by what they are
(`programs._Canonicalizer._carry_classes`), so such loops compare as the same
program, while a carried value computed otherwise, of another dtype, or
missing is still a difference. Small jitted functions, lowered only, through
the entry point the battery's program part uses (`compiling.program_diff_of`).
"""
import itertools

import jax
import jax.numpy as jnp
import pytest

from parity.compare import programs
from parity.run import compiling

NAMES = ['w', 'v', 'xs']


def _scan(order: str, b_update: str = '+1', s_dtype: str = 'float32', extra: bool = False) -> str:
  """A scan over `xs` carrying, in `order`, a (3-vector, from w), b (3-vector, from v), s and t
  (scalar sums, from 0), n (a counter, from 0); `extra`: m (a second counter) too. `b_update`
  is how b steps ('+1', '+2' or '*2'); `s_dtype` the sum s's dtype. Returns the lowered text."""
  keys = order + ('m' if extra else '')
  step = {'+1': lambda b: b + 1.0, '+2': lambda b: b + 2.0, '*2': lambda b: b * 2.0}[b_update]

  def body(carry, x):
    c = dict(zip(keys, carry))
    new = {'a': c['a'] * x, 'b': step(c['b']), 's': c['s'] + c['a'].sum().astype(s_dtype),
           't': c['t'] + c['b'].sum(), 'n': c['n'] + 1, 'm': c.get('m', 0) + 2}
    return tuple(new[k] for k in keys), c['a'] + c['b']

  def f(w, v, xs):
    init = {'a': w, 'b': v, 's': jnp.zeros((), s_dtype), 't': jnp.float32(0), 'n': jnp.int32(0),
            'm': jnp.int32(0)}
    carry, ys = jax.lax.scan(body, tuple(init[k] for k in keys), xs)
    c = dict(zip(keys, carry))
    return c['a'], c['b'], c['s'].astype('float32'), c['t'], c['n'], c.get('m', 0), ys

  return jax.jit(f).lower(jnp.ones(3), jnp.ones(3), jnp.ones((4, 3))).as_text()


def _diff(linen: str, nnx_: str) -> programs.ProgramDiff:
  """The two programs compared as the battery's program part compares two train steps."""
  def step(text):
    return compiling.CompiledStep(None, text, 0.0, 0.0, text, NAMES)
  return compiling.program_diff_of(step(linen), step(nnx_))


@pytest.mark.parametrize('order', ['tnsba', 'nbtas'])
def test_scans_carrying_the_same_values_in_another_order_are_the_same_program(order):
  """The carry tuple permuted: the canonical programs are equal and the programs identical;
  the loop's order is noted (XLA schedules from it, the memory part measures that), not a
  difference."""
  linen, nnx_ = _scan('absnt'), _scan(order)
  assert programs.loop_carries(linen) != programs.loop_carries(nnx_)  # the text's order does differ
  assert programs.canonicalize(linen, NAMES) == programs.canonicalize(nnx_, NAMES)
  d = _diff(linen, nnx_)
  assert d.identical, d.summary() + '\n' + d.diff
  assert d.summary().startswith('programs identical (') and d.first_difference is None
  assert 'loop 0 (of 1, in program order) carries the same 8 values in another order' in d.loop_order


@pytest.mark.parametrize('b_update, linen_op, nnx_op', [
    ('+2', 'stablehlo.constant dense<1.000000e+00>', 'stablehlo.constant dense<2.000000e+00>'),
    ('*2', 'stablehlo.add', 'stablehlo.multiply'),
], ids=['another-constant', 'another-operation'])
def test_a_carried_value_computed_otherwise_is_a_difference(b_update, linen_op, nnx_op):
  """b steps by adding a constant in Linen, by adding another or multiplying by it in NNX, in a
  loop carrying its values in another order besides: the programs differ, and where they part
  names the operation on each side."""
  linen, nnx_ = _scan('absnt', '+1' if b_update == '+2' else '+2'), _scan('tnsba', b_update)
  d = _diff(linen, nnx_)
  assert not d.identical and d.changed_lines > 0 and d.loop_order == ''
  assert d.summary().startswith('programs differ: first difference at canonical line'), d.summary()
  assert any(linen_op in line for line in d.parting_linen), d.parting_lines()
  assert any(nnx_op in line for line in d.parting_nnx), d.parting_lines()
  assert not any(nnx_op in line for line in d.parting_linen), d.parting_lines()


def test_a_carried_value_of_another_dtype_is_a_difference():
  """The sum s carried in bfloat16 on one side: the programs differ, the loops carry other
  types (`loop_order_difference` names the loop), and where they part shows the dtype."""
  linen, nnx_ = _scan('absnt'), _scan('tnsba', s_dtype='bfloat16')
  d = _diff(linen, nnx_)
  assert not d.identical and d.changed_lines > 0, d.summary()
  assert any('bf16' in line for line in d.parting_nnx) and not any('bf16' in line for line in d.parting_linen)
  assert 'tensor<bf16>' in d.diff
  assert programs.loop_order_difference(linen, nnx_) == 'loop 0 (of 1, in program order) carries other types'


def test_a_carried_value_one_side_lacks_is_a_difference():
  """NNX's loop carries one counter more, m, which it returns where Linen returns 0: the
  programs differ and the summary names the loop and the value only NNX carries."""
  linen, nnx_ = _scan('absnt'), _scan('tnsba', extra=True)
  d = _diff(linen, nnx_)
  assert not d.identical, d.summary()
  assert d.loop_growth.startswith("NNX's loop 0 carries 1 values more than Linen's loop 0 (of 1, in program"
                                  ' order): tensor<i32>'), d.loop_growth
  assert d.loop_growth in d.summary()


def _while(order: str, rule: str, result: str | None = None) -> str:
  """A while loop over a counter i (from 0, to 5) and vectors or counters that start alike, carried
  in `order`; `rule` says how each steps; `result`: the one value the function returns (else
  all). Values that start alike are told apart by what they become (`chain`: p and q part once
  r and s have), or step alike and so are one value, whichever the program reads (`constants`:
  p and q never change, as a scan's constant jax passes twice, each read in another place;
  `counters`: i and n count alike, the condition reads i; `cycle`: p, q and r take each other's
  differences in turn)."""
  rules = {
      'chain': lambda c: {'i': c['i'] + 1, 'p': c['p'] + c['r'], 'q': c['q'] + c['s'], 'r': c['r'] * 2.0,
                          's': c['s'] * 3.0},
      'constants': lambda c: {'i': c['i'] + 1, 'p': c['p'], 'q': c['q'], 'r': c['r'] + c['p'] * 2.0 - c['q']},
      'counters': lambda c: {'i': c['i'] + 1, 'n': c['n'] + 1, 'p': c['p'] * 2.0},
      'cycle': lambda c: {'i': c['i'] + 1, 'p': c['q'] - c['r'], 'q': c['r'] - c['p'], 'r': c['p'] - c['q']},
  }

  def f(x):
    init = tuple(jnp.int32(0) if k in 'in' else x for k in order)
    step = lambda carry: tuple(rules[rule](dict(zip(order, carry)))[k] for k in order)
    out = dict(zip(order, jax.lax.while_loop(lambda carry: dict(zip(order, carry))['i'] < 5, step, init)))
    return out[result] if result else tuple(out[k] for k in sorted(order))

  return jax.jit(f).lower(jnp.ones(3)).as_text()


@pytest.mark.parametrize('rule, values', [('chain', 'ipqrs'), ('constants', 'ipqr'), ('counters', 'inp'),
                                          ('cycle', 'ipqr')])
def test_values_that_start_alike_are_ordered_by_what_they_are_whatever_their_place(rule, values):
  """Carried values of one type and initial value: every order of them in the loop gives one
  canonical program (the first three orders of each, and the reverse)."""
  orders = list(itertools.islice(itertools.permutations(values), 3)) + [tuple(reversed(values))]
  texts = [_while(''.join(order), rule) for order in orders]
  # The orders are other texts. jax 0.12 forwards loop-invariant carries out of the loop (the
  # `constants` rule's p and q), so two of those orders lower to one text there: 3 texts of 4.
  assert len(set(texts)) >= len(texts) - (rule == 'constants'), len(set(texts))
  forms = {programs.canonicalize(t, ['x']) for t in texts}
  assert len(forms) == 1, f'{len(forms)} canonical forms for {len(texts)} orders of one loop'


def test_values_that_start_alike_and_step_otherwise_are_told_apart():
  """p and q start alike, and step by r and by s, which step otherwise: a program returning p
  differs from one returning q, in the same order or another."""
  for order in ('ipqrs', 'isrqp'):
    d = programs.diff(_while('ipqrs', 'chain', 'p'), _while(order, 'chain', 'q'), linen_args=['x'], nnx_args=['x'])
    assert not d.identical, order
  assert programs.diff(_while('ipqrs', 'chain', 'p'), _while('isrqp', 'chain', 'p'),
                       linen_args=['x'], nnx_args=['x']).identical


def _loop_headers(text: str) -> list[str]:
  """Each loop's header line: what it carries, from what, in the text's order."""
  return [line.strip() for line in text.splitlines() if 'stablehlo.while(' in line]


def _nested(outer: tuple[str, ...], inner: str, r_update: str = '-') -> str:
  """A scan carrying u, v and the rows xs in `outer` order, whose body runs a scan carrying p, q,
  r in `inner` order over the rows; `r_update`: how r steps by p ('-' or '+')."""
  def inner_body(carry, x):
    c = dict(zip(inner, carry))
    new = {'p': c['p'] + x, 'q': c['q'] * x, 'r': c['r'] - c['p'] if r_update == '-' else c['r'] + c['p']}
    return tuple(new[k] for k in inner), None

  def outer_body(carry, x):
    c = dict(zip(outer, carry))
    init = {'p': c['u'], 'q': c['v'], 'r': x}
    out = dict(zip(inner, jax.lax.scan(inner_body, tuple(init[k] for k in inner), c['xs'])[0]))
    new = {'u': out['p'] + out['r'], 'v': out['q'], 'xs': c['xs']}
    return tuple(new[k] for k in outer), None

  def f(w, v, xs):
    init = {'u': w, 'v': v, 'xs': xs}
    out = dict(zip(outer, jax.lax.scan(outer_body, tuple(init[k] for k in outer), xs)[0]))
    return out['u'], out['v']

  return jax.jit(f).lower(jnp.ones(3), jnp.ones(3), jnp.ones((4, 3))).as_text()


def test_a_loop_in_a_loop_is_the_same_program_whatever_either_carries_first():
  """Both the outer and the inner scan carry their values in another order: the same program;
  the inner loop stepping one value otherwise is still a difference."""
  linen = _nested(('u', 'v', 'xs'), 'pqr')
  for outer, inner in ((('xs', 'v', 'u'), 'rqp'), (('u', 'xs', 'v'), 'qpr')):
    nnx_ = _nested(outer, inner)
    assert _loop_headers(linen) != _loop_headers(nnx_)  # the text's order does differ
    d = _diff(linen, nnx_)
    assert d.identical, d.summary() + '\n' + d.diff
  d = _diff(linen, _nested(('xs', 'v', 'u'), 'rqp', r_update='+'))
  assert not d.identical and any('stablehlo.add' in line for line in d.parting_nnx), d.parting_lines()
