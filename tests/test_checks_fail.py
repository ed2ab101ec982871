"""The battery's checks proven by the core tier: each fails on the bug it exists to catch.

A bug in the kit's comparison would let every broken port pass. Each test plants, in the
NNX side of a tiny pair (tests/small_pairs.py `planted`), the bug one check exists to catch,
and asserts that the check fails naming what differs: gradients leaf by leaf with the loss
bitwise equal; decoded tokens, logits and cache each; eval-mode outputs; declared bounds
(tight, proven by a substitution that removes the difference); the guards against comparing
nothing; state only NNX keeps; a call paired with the wrong Linen module; dropout keys. A
few run the same check on a pair without the bug, where it must pass. Pairs of the same
options share their sides, and each pair its runs, so every program compiles once.
"""
from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import parity
from parity.battery import checks
from parity.run import compiling, runner
from tests import small_pairs

pytestmark = pytest.mark.xdist_group('parity-checks-fail')

_LEAF = re.compile(r'^  (\S+): (bits|shape|dtype|missing|extra): ', re.MULTILINE)


_pair = small_pairs.planted_once  # the planted pair `name` with `bugs`, its runs shared
_failure = small_pairs.failure_of


def _differing(message: str) -> list[str]:
  """The leaves a failure lists as differing, in its order."""
  return [path for path, _ in _LEAF.findall(message)]


# --- 1. Gradients, leaf by leaf --------------------------------------------------------


def test_grads_fail_on_one_parameters_gradient_with_the_loss_bitwise_equal():
  """NNX stops the gradient at `inp`'s output: the same loss, no gradient for Dense_0's kernel."""
  message = _failure(checks.check_grads, _pair('frozen', frozen=True))
  assert message.startswith('frozen: loss and gradients are not bit-identical: 1 leaf/leaves differ'), message
  assert _differing(message) == ['params/Dense_0/kernel'], message


# --- 2. Decoding: tokens, logits and cache each ------------------------------------------


@pytest.mark.parametrize('bug,headline,leaf', [
    ('tokens', 'decoded tokens (greedy, one_device; first differing decode step: 0 of 4)', 'tokens'),
    ('logits', 'decoded logits (greedy, one_device; first differing decode step: 0 of 4)', 'logits'),
    ('cache', 'decoded tokens, logits and final cache (greedy, one_device)', 'cache/index'),
], ids=['tokens', 'logits', 'cache'])
def test_decode_fails_on_tokens_logits_and_cache_each(bug, headline, leaf):
  """Each bug changes one of them only: tokens returned otherwise than drawn; logits doubled
  (the same argmax, so the same greedy tokens and cache); a cache index the logits never read."""
  message = _failure(checks.check_decode, _pair(f'decode_{bug}', decode=bug), 'one_device')
  assert message.startswith(f'decode_{bug}: {headline} are not bit-identical: 1 leaf/leaves differ'), message
  assert _differing(message) == [leaf], message


def test_decode_passes_where_nothing_is_planted():
  assert checks.check_decode(_pair('base'), 'one_device') == [
      'greedy, one_device: 4 tokens, their logits and 2 cache arrays bit for bit']


# --- 3. Eval-mode outputs ---------------------------------------------------------------


def test_eval_fails_on_outputs_that_differ_in_eval_mode_only():
  """NNX scales its hidden activations in eval mode (inference-time dropout scaling): training is
  bit for bit, the eval-mode outputs are not."""
  pair = _pair('eval_scaled', eval_scaled=True)
  assert checks.check_train(pair, 'linen') == []
  message = _failure(checks.check_eval, pair)
  assert message.startswith("eval_scaled: eval-mode outputs from one state (the Linen run's after 2 steps)"
                            ' are not bit-identical: 1 leaf/leaves differ'), message
  # The metrics from one state are compared too, and reported with the outputs.
  assert ("\neval_scaled: eval metrics from one state (the Linen run's after 2 steps) are not bit-identical"
          in message), message
  assert _differing(message) == ['outputs', 'loss'], message
  # The eval localizer: the scaling is the model's own code, between its dropout and Dense_1.
  assert ('\n  eval localizer: first differs inside module (model), outside its submodules (the input of'
          ' Dense_1 (NNX: hidden1) differs), run eagerly in eval mode (its argument ') in message, message


def test_eval_fails_on_metrics_that_differ_where_the_outputs_agree():
  """NNX's eval step reports the root of the mean squared error as its loss."""
  message = _failure(checks.check_eval, _pair('eval_rmse', eval_rmse=True))
  assert message.startswith("eval_rmse: eval metrics from one state (the Linen run's after 2 steps) are not"
                            ' bit-identical: 1 leaf/leaves differ'), message
  assert _differing(message) == ['loss'], message
  assert ('\n  eval localizer: all 6 module calls of the eval step agree bit for bit when run eagerly: the'
          " difference arises outside the modules (the step's loss or metrics on the outputs)") in message, message


def test_eval_names_a_dropout_left_on_in_eval_mode():
  """NNX's dropout, holding its stream, is on in eval mode too (a model.eval() forgotten): training
  is bit for bit (the kit seeds the stream with Linen's keys), eval is not, and only the eval
  localizer, which runs the eval step's modules, can name the dropout."""
  pair = _pair('eval_dropping', stream=True, eval_dropping=True, dropout_keys='linen')
  assert checks.check_train(pair, 'linen') == []
  message = _failure(checks.check_eval, pair)
  assert message.startswith("eval_dropping: eval-mode outputs from one state"), message
  assert ('\n  eval localizer: first differs at module Dropout_0 (NNX: dropout), run eagerly in eval mode ('
          in message), message
  assert ("; Linen's call returned its input unchanged and the other side's did not: a dropout off in this"
          ' mode (deterministic), or a layer skipped\n') in message, message
  assert ("\n  Dropout_0: NNX's dropout dropped in eval mode, Linen's did not: NNX's eval step leaves it on."
          in message), message


# --- 4. Declared bounds: tight, proven, confined -----------------------------------------


def _one_ulp(name: str, **bound) -> parity.Pair:
  """NNX's decoded logits one ULP up (the same argmax), declared with `bound`."""
  known = parity.KnownDifference(('logits',), ('decode',), reason='planted: NNX logits one ULP up', **bound)
  return _pair(name, decode='ulp', pair_options={'known_differences': (known,)})


def test_a_value_bound_far_wider_than_measured_is_refused_as_loose():
  pair = _one_ulp('ulp_loose', max_ulp=10**6, substitute=small_pairs.planted_sides())
  message = _failure(checks.check_decode, pair, 'one_device')
  assert ("KnownDifference(('logits',), 'decode', max_ulp=1000000) is loose: the measured maximum is 1 ULP;"
          ' declare max_ulp=1') in message, message


def test_a_tight_value_bound_with_a_substitution_that_removes_it_is_accepted():
  pair = _one_ulp('ulp_tight', max_ulp=1, substitute=small_pairs.planted_sides())
  lines = checks.check_decode(pair, 'one_device')
  assert lines[0] == 'logits: 1 ULP (declared bound 1, measured maximum 1 ULP: planted: NNX logits one ULP up)', lines
  assert checks.check_substitution(pair) == [
      'logits: with the substitution, grads, train, eval, the localizer and decoding are bit for bit: the'
      ' declared modules are the only source']


def test_a_difference_beyond_its_declared_bound_fails():
  """NNX's decoded logits doubled (2**23 ULP), declared within 1 ULP."""
  known = parity.KnownDifference(('logits',), ('decode',), reason='planted: NNX logits doubled', max_ulp=1,
                                 substitute=small_pairs.planted_sides())
  pair = _pair('doubled_declared', decode='logits', pair_options={'known_differences': (known,)})
  message = _failure(checks.check_decode, pair, 'one_device')
  assert ('\n  logits: 8388608 ULP (declared bound 1, measured maximum 8388608 ULP: planted: NNX logits doubled)'
          in message), message


def test_bounds_over_nothing_that_differs_are_refused():
  """The pair without a bug, declaring a value bound on its logits and a program bound on Dense_3."""
  logits = parity.KnownDifference(('logits',), ('decode',), reason='nothing', max_ulp=1,
                                  substitute=small_pairs.planted_sides())
  message = _failure(checks.check_decode, _pair('declared_value', pair_options={'known_differences': (logits,)}),
                     'one_device')
  assert ("KnownDifference(('logits',), 'decode', max_ulp=1): nothing differs under it (measured maximum 0 ULP):"
          ' remove the declaration') in message, message
  program = parity.KnownDifference(('Dense_3',), ('program',), reason='nothing', max_changed_lines=10)
  message = _failure(checks.check_program, _pair('declared_program', pair_options={'known_differences': (program,)}))
  assert message.startswith("declared_program: KnownDifference(('Dense_3',), 'program', max_changed_lines=10):"
                            ' nothing differs under it (the program is the same on both sides): remove'
                            " 'program' from its passes"), message


def test_a_value_bound_without_a_substitution_is_refused():
  pair = _one_ulp('ulp_unproven', max_ulp=1)
  for message in (_failure(checks.check_decode, pair, 'one_device'), _failure(checks.check_substitution, pair)):
    assert "KnownDifference(('logits',), 'decode', max_ulp=1) has no substitution" in message, message


def test_a_substitution_that_leaves_the_difference_fails_the_substitution_part():
  pair = _one_ulp('ulp_unremoved', max_ulp=1, substitute=small_pairs.planted_sides(decode='ulp'))
  checks.check_decode(pair, 'one_device')  # within its bound
  message = _failure(checks.check_substitution, pair)
  assert message.startswith('ulp_unremoved: with the substitution of logits (planted: NNX logits one ULP up)'
                            ' the pair is still not bit-identical'), message
  assert _differing(message) == ['logits'], message


def test_a_program_bound_far_wider_than_measured_is_refused_as_loose():
  """flax's stock LayerNorm lowers otherwise in Linen and NNX (the same numbers): declared with a
  bound far above the lines measured, refused; declared with the lines measured, accepted."""
  norm = parity.KnownDifference(('LayerNorm_0',), ('program',), max_changed_lines=10**6,
                                reason="planted: flax's stock layer norm")
  pair = _pair('norm_loose', norm=True, pair_options={'known_differences': (norm,)})
  message = _failure(checks.check_program, pair)
  found = re.search(r"KnownDifference\(\('LayerNorm_0',\), 'program', max_changed_lines=1000000\) is loose:"
                    r' the measured figure is (\d+) canonical lines', message)
  assert found, message
  measured = int(found[1])
  assert 0 < measured < 10**6 // 4, message
  tight = dataclasses.replace(pair, name='norm_tight',
                              known_differences=(dataclasses.replace(norm, max_changed_lines=measured),))
  assert checks.check_program(tight) == [
      f"{measured} canonical lines (declared bound {measured}, LayerNorm_0: planted: flax's stock layer norm);"
      ' identical outside those modules']
  elsewhere = dataclasses.replace(pair, name='norm_elsewhere', known_differences=(
      dataclasses.replace(norm, paths=('Dense_3',), max_changed_lines=measured),))
  message = _failure(checks.check_program, elsewhere)
  assert message.startswith('norm_elsewhere: the programs differ outside the modules declared (Dense_3)'), message


# --- 5. Nothing compared: never a pass ---------------------------------------------------


@pytest.mark.parametrize('check,args', [
    (checks.check_grads, ()), (checks.check_train, ('linen',)), (checks.check_eval, ()),
    (checks.check_checkpoint, ('linen->nnx',)), (checks.check_localize, ()), (checks.check_memory, ()),
    (checks.check_program, ()), (checks.check_decode, ('one_device',)),
], ids=['grads', 'train', 'eval', 'checkpoints', 'localize', 'memory', 'program', 'decode'])
def test_sides_that_share_no_parameter_path_compare_nothing_and_fail(check, args):
  """NNX's modules named by their attributes, with no correspondence inferred: no path in common."""
  pair = _pair('apart', infer_renames=False)
  message = _failure(check, pair, *args)
  assert message.startswith("apart: the two sides' states differ in the checkpoint layout, so nothing is"
                            ' compared here'), message
  assert '\n  params/Dense_0/kernel: missing: expected float32[8, 8], got nothing\n' in message, message


def test_declared_resolved_activations_with_no_constraint_compare_nothing_and_fail():
  pair = _pair('resolved_none', pair_options={'activations_resolved': True})
  assert _failure(checks.check_specs, pair) == (
      'resolved_none: nothing compared: no activation constraint in either train step on data=8, though'
      ' the pair declares activations_resolved')


def test_memory_not_measured_compares_nothing_and_fails(monkeypatch):
  """A backend without XLA's memory analysis."""
  monkeypatch.setattr(compiling, 'memory_of', lambda executable, device: {})
  message = _failure(checks.check_memory, _pair('base'))
  assert message.startswith('base: XLA memory analysis not measured on cpu'), message
  assert 'nothing compared' in message, message


class _Wrapped:
  """A side of the user's own, delegating to a stock side."""

  def __init__(self, side):
    self._side = side

  def __getattr__(self, name):
    return getattr(self._side, name)

  @classmethod
  def around(cls, pair: parity.Pair, name: str) -> parity.Pair:
    """`pair` with both its sides wrapped."""
    return dataclasses.replace(pair, name=name, make_sides=lambda mesh: tuple(map(cls, pair.make_sides(mesh))))


class _NoProbe(_Wrapped):
  """A probe that records nothing (one of the user's own that misses every call)."""

  def probe(self, state, batch, dropout_key):
    return parity.Probe(order=[], inputs={}, outputs={}, cotangents={}, param_grads={})


class _NoGradients(_Wrapped):
  """`value_and_grads` giving the loss and no gradient."""

  def value_and_grads(self, state, batch, dropout_key):
    return self._side.value_and_grads(state, batch, dropout_key)[0], {}


def test_a_localizer_that_records_nothing_fails():
  message = _failure(checks.check_localize, _NoProbe.around(_pair('base'), 'no_probe'))
  assert 'no module call found on both sides' in message, message
  assert 'no parameter gradient found on both sides' in message, message


# Parts that would compare nothing, and pass, are refused.


def test_sides_that_give_no_gradient_compare_nothing_and_fail():
  """The frozen pair's bug (Dense_0's kernel without gradient), its sides giving no gradient."""
  message = _failure(checks.check_grads, _NoGradients.around(_pair('frozen', frozen=True), 'no_gradients'))
  assert "the linen side's value_and_grads gives no gradient for 7 of the 7 parameters" in message, message


@pytest.mark.parametrize('decode, refusal', [({'steps': 0}, 'Decode steps: a whole number of tokens'),
                                             ({'temperatures': ()}, 'Decode temperatures: a tuple of one or more')],
                         ids=['steps=0', 'no_temperature'])
def test_decoding_nothing_is_refused(decode, refusal):
  """A decode part with no token, or at no temperature, would compare nothing: refused as declared."""
  with pytest.raises(ValueError, match=refusal):
    parity.Decode(small_pairs.planted_prompt, **decode)


# --- 6. State only NNX keeps ------------------------------------------------------------


def test_state_only_nnx_keeps_declared_is_accounted_in_memory_to_the_byte():
  pair = _pair('counted', counted=True, nnx_only=(nnx.RngState, small_pairs.Calls))
  checks.check_structure(pair)
  lines = checks.check_memory(pair)
  assert len(lines) == 1 and lines[0].startswith(
      "state only NNX keeps (1 leaves, 4 B: 0/calls): NNX's step compared without it, as the program part"
      ' compares it (it adds argument_bytes +4 B, '), lines


def test_state_only_nnx_keeps_undeclared_fails_the_structure_and_checkpoints():
  pair = _pair('counted_undeclared', counted=True)
  message = _failure(checks.check_structure, pair)
  assert '\n  0/calls: type: expected one of Param, BatchStat, got Calls' in message, message
  message = _failure(checks.check_checkpoint, pair, 'nnx->linen')
  assert message.startswith("counted_undeclared: the two sides' states differ in the checkpoint layout, so"
                            ' nothing is compared here'), message
  assert '0/calls: type: expected one of Param, BatchStat, got Calls' in message, message


def test_state_only_nnx_keeps_is_accounted_to_the_byte_where_no_program_is_compared():
  """`parity compare --no-program-check` (or a pair whose parts leave 'program' out): NNX's step
  has no comparison lowering, so its memory is accounted by taking the state's bytes, and their
  entries in the output table, off NNX's arguments and outputs (compiling.without_nnx_only's other
  branch, which the battery's memory part does not take)."""
  from parity.pairs import adapter

  pair = _pair('counted', counted=True, nnx_only=(nnx.RngState, small_pairs.Calls))
  result = runner.compare_sides(adapter.make_pair_sides(pair, None), lambda step: pair.batch(step, 'train'), 1,
                                program_diff=False, localize_divergence=False)
  assert result.bitwise_equal, result.verdict()
  assert result.memory_verdict.startswith(
      'equal to the byte (state only NNX keeps (1 leaves, 4 B: 0/calls): NNX arguments less 4 B, outputs'
      ' less 12 B'), result.memory_verdict


class _ParamsOnlyRestore(_Wrapped):
  """A restore of the parameters alone, into a fresh state: its step counter back at 0."""

  def from_checkpoint(self, flat):
    fresh = self._side.to_checkpoint(self._side.init(0))
    return self._side.from_checkpoint({**fresh, **{p: x for p, x in flat.items() if p.startswith('params/')}})


def test_a_restore_that_loses_the_step_fails_checkpoints_and_resume():
  """NNX restores its parameters only: the restored state's step differs, and the steps after a
  resume draw the masks of the steps counted again from 0."""
  base = _pair('base')
  pair = dataclasses.replace(
      base, name='params_only_restore',
      make_sides=lambda mesh: (base.make_sides(mesh)[0], _ParamsOnlyRestore(base.make_sides(mesh)[1])))
  message = _failure(checks.check_checkpoint, pair, 'linen->nnx')
  assert message.startswith('params_only_restore: checkpoint linen->nnx (saved vs restored, checkpoint layout)'
                            ' are not bit-identical: 1 leaf/leaves differ'), message
  assert '\n  step: bits: ' in message, message
  message = _failure(checks.check_resume, pair, 'linen->nnx')
  leaves = _differing(message)
  assert 'loss/step_1' in leaves and 'loss/step_0' not in leaves and 'step' in leaves, message


# --- 7. Call-level correspondences ------------------------------------------------------


def test_a_call_paired_with_the_wrong_linen_module_fails_naming_the_paths():
  """Renames pair Dense_1 with `hidden1` and Dense_2 with `hidden2`; NNX calls `hidden2` first."""
  message = _failure(checks.check_grads, _pair('swapped', swapped=True, renames=small_pairs.SWAPPED_RENAMES))
  assert 'params/Dense_1/kernel' in _differing(message) and 'params/Dense_2/kernel' in _differing(message), message
  assert 'first differs at module Dense_1' in message, message


# --- 8. Dropout keys --------------------------------------------------------------------


def test_dropout_keys_that_ignore_the_step_fail_the_train_part():
  """NNX draws step 0's masks at every step: step 0 agrees, step 1 does not."""
  message = _failure(checks.check_train, _pair('fixed_key', fixed_key=True), 'linen')
  leaves = _differing(message)
  assert 'loss/step_1' in leaves and 'loss/step_0' not in leaves, message


def test_a_dropout_holding_its_stream_draws_each_steps_key_in_training():
  """The kit seeds a stream the NNX model holds with the key Linen's step derives, step by step:
  two steps of training are bitwise (a seed that ignored the step would fail step 1)."""
  assert checks.check_train(_pair('stream_linen', stream=True, dropout_keys='linen'), 'linen') == []


def _linen_dropout(x, key):
  """nn.Dropout(0.5)'s formula with `key` (flax/linen/stochastic.py)."""
  return jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x / 0.5, 0.0)


class _DrawsTwice(nn.Module):
  """One scope drawing make_rng('dropout') twice in a call (counts 1 and 2), dropping out with each."""

  @nn.compact
  def __call__(self, x):
    return _linen_dropout(_linen_dropout(x, self.make_rng('dropout')) * 3.0, self.make_rng('dropout'))


class _Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _DrawsTwice(name='inner')(x)


class _LinenDropoutTwice(nn.Module):
  """One nn.Dropout called twice: Linen draws counts 1 and 2 at `Dropout_0`, each call in a scope
  object of its own."""

  @nn.compact
  def __call__(self, x):
    drop = nn.Dropout(0.5, deterministic=False)
    return drop(drop(x) * 3.0)


class _NnxDropoutTwice(nnx.Module):
  def __init__(self):
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs):
    return self.drop(self.drop(x, deterministic=False, rngs=rngs) * 3.0, deterministic=False, rngs=rngs)


@pytest.mark.parametrize('linen_model,path', [(_Outer, 'inner'), (_LinenDropoutTwice, 'Dropout_0')],
                         ids=['one_scope_draws_twice', 'one_dropout_called_twice'])
def test_each_draw_at_one_linen_path_gets_its_own_count(linen_model, path):
  """Linen draws twice at one path (counts 1 and 2); NNX's one dropout, tagged with that path, is
  called twice: its second call draws count 2, not the first count again, and its first count 1
  (a dropout called twice draws in two scope objects of one trace)."""
  from parity.compare import scopes
  from parity.core import rng
  from parity.pairs import dropout

  key = rng.step_key(rng.base_key(0), 1, 0)
  x = jnp.arange(1.0, 257.0)
  apply = lambda x: linen_model().apply({}, x, rngs={'dropout': key})  # noqa: E731
  draws = dropout.linen_draws(apply, x)
  assert draws == {path: (1, 2)}, draws
  model = _NnxDropoutTwice()
  scopes.tag_paths(model, {'drop': path}.get)
  with dropout.linen_dropout_keys({}, draws) as substituted:
    parity.assert_bitwise_equal(jax.jit(lambda x: model(x, nnx.Rngs(dropout=key)))(x), apply(x))
  assert dict(substituted) == {path: 1, f'{path}#1': 1}


@pytest.mark.parametrize('scheme', ['linen', 'nnx'])
def test_a_dropout_holding_its_stream_is_bitwise_with_linens_keys_only(scheme):
  """A stock nnx.Dropout(rate, rngs=rngs) called without a key, against nn.Dropout's make_rng."""
  pair = _pair(f'stream_{scheme}', stream=True, dropout_keys=scheme)
  if scheme == 'linen':
    assert checks.check_grads(pair) == []
    return
  message = _failure(checks.check_grads, pair)
  assert 'params/Dense_0/kernel' in _differing(message), message
  assert 'first differs at module Dropout_0' in message and "dropout_keys='linen'" in message, message


def test_a_kept_stream_forked_from_another_stream_than_dropout_is_left_as_drawn_and_named():
  """nnx.Dropout(rate, rng_collection='params', rngs=rngs): the stream is forked from the model's
  params stream, where Linen's dropout draws make_rng('dropout'). The kit gives Linen's keys to
  'dropout' streams only, so this one draws its own masks and the pair fails there (it passed
  while every kept stream was seeded, whatever it was forked from)."""
  message = _failure(checks.check_grads, _pair('stream_of_params', stream='params', dropout_keys='linen'))
  assert 'params/Dense_0/kernel' in _differing(message), message
  assert 'first differs at module Dropout_0' in message, message
  assert ("draws from a stream the NNX model keeps that is forked from another stream than 'dropout'"
          " (dropout/rngs of 'params')") in message, message


def test_a_kept_stream_of_a_model_made_with_one_default_seed_gets_linens_keys():
  """nnx.Rngs(seed) alone, the NNX tutorials' idiom: the dropout's stream falls back to the model's
  'default' stream, the only one it has. Its dropout is of the 'dropout' collection, so the kit
  seeds it as a 'dropout' stream, and the pair is bit for bit (it failed, its stream left as drawn)."""
  pair = _pair('stream_default', stream=True, default_rngs=True, dropout_keys='linen')
  assert checks.check_grads(pair) == []
  assert checks.check_train(pair, 'linen') == []


def test_a_dropout_off_in_train_mode_is_named_as_not_drawing_not_as_other_keys():
  """The NNX dropout given the mode the other way round (deterministic=train): in train mode it
  returns its input, where Linen's drops. The localizer says which side's call returned its input
  unchanged, and the hint points at the mode, not at the keys the kit seeds."""
  message = _failure(checks.check_grads, _pair('mode_flipped', stream=True, mode_flipped=True, dropout_keys='linen'))
  assert 'first differs at module Dropout_0 (NNX: dropout)' in message, message
  assert ("NNX's call returned its input unchanged and the other side's did not: a dropout off in this"
          ' mode (deterministic)') in message, message
  assert "Dropout_0: NNX's dropout returned its input unchanged, where the other side's dropped" in message, message
  assert 'still differs' not in message, message


# --- 7. A check's own bug: each test fails where the check compares the wrong thing ---------


def test_convert_resumes_from_the_converted_checkpoint(monkeypatch):
  """The converted checkpoint, as the target side restores it, changed by one step's worth: the convert
  part fails. A part that resumed from anything but the converted checkpoint (the kit's own layout,
  the source state) would pass."""
  from parity.store import pair_convert

  restore = pair_convert.restore_native

  def restored_otherwise(item, layout, side):
    state = restore(item, layout, side)
    return jax.tree.map(lambda x: x * 2 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

  monkeypatch.setattr(pair_convert, 'restore_native', restored_otherwise)
  message = _failure(checks.check_convert, _pair('base'), 'linen->nnx')
  assert message.startswith("base: linen's own checkpoint after step 0, converted"), message
  assert 'resumed in nnx' in message and 'params/Dense_0/kernel' in _differing(message), message


def test_the_zero_gradient_report_names_every_parameter_no_gradient_reaches():
  """Dense_1 and Dense_2 initialised to zeros on both sides: the loss and gradients agree, and the grads
  part names the parameters whose gradients are exactly zero as not proven (a report that came back
  empty would say they were)."""
  lines = checks.check_grads(_pair('zero', zero=True))
  unproven = [line for line in lines if line.startswith('not proven by values: ')]
  assert len(unproven) == 1, lines
  assert unproven[0].startswith('not proven by values: 6 parameter(s) whose gradient is exactly zero on both sides'), lines
  for path in ('params/Dense_0/kernel', 'params/Dense_1/kernel', 'params/Dense_1/bias', 'params/Dense_2/kernel',
               'params/Dense_2/bias', 'params/Dense_3/kernel'):
    assert path in unproven[0], unproven[0]


def _constrained_loss_train(model, optimizer, batch, dropout_base):
  """The planted pair's NNX train step, its loss constrained replicated: the same numbers, one
  more sharding annotation in the program."""
  from jax.sharding import PartitionSpec

  metrics = small_pairs._planted_nnx_code((), False, None, False)[1](model, optimizer, batch, dropout_base)
  return {'loss': jax.lax.with_sharding_constraint(metrics['loss'], PartitionSpec())}


def test_the_mesh_part_compares_both_sides_lowerings():
  """An NNX step with one sharding constraint Linen's has not (on its loss: no number changes): the mesh
  part fails on the annotations. A part that compared one side's lowering with itself would pass."""
  base = _pair('base')

  def make_sides(mesh):
    linen, nnx_side = base.make_sides(mesh)
    return linen, dataclasses.replace(nnx_side, train_step_fn=nnx.jit(_constrained_loss_train))

  pair = dataclasses.replace(base, name='constrained_loss', make_sides=make_sides)
  message = _failure(checks.check_mesh, pair, 'data=8')
  assert message.startswith('constrained_loss: sharding annotations of the train steps differ on data=8 (the'
                            ' train metrics and final state there are bit-identical)'), message


def test_the_canonical_program_folds_transposes_that_undo_each_other_only():
  """transpose(transpose(x)) reads as x where the second undoes the first; two that do not stay."""
  from parity.compare import programs

  x = jax.ShapeDtypeStruct((3, 3, 3), jnp.float32)

  def canonical(f):
    return programs.canonicalize(jax.jit(f).lower(x).as_text(), ['x'])

  plain = canonical(lambda x: x * 2)
  assert canonical(lambda x: jnp.transpose(jnp.transpose(x, (1, 0, 2)), (1, 0, 2)) * 2) == plain
  assert canonical(lambda x: jnp.transpose(jnp.transpose(x, (1, 2, 0)), (2, 0, 1)) * 2) == plain
  other = canonical(lambda x: jnp.transpose(jnp.transpose(x, (1, 0, 2)), (0, 2, 1)) * 2)
  assert other != plain and other.count('stablehlo.transpose') == 2, other
