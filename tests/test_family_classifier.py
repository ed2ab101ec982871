"""The convolutional classifier family, through the plugin only.

Stock flax layers on both sides (models/linen/classifier.py,
models/nnx/classifier.py): Linen's automatic names against NNX attributes,
the Linen `batch_stats` collection against `nnx.BatchStat`, train and eval
mode, and dropout on. Dropout is bitwise because both models pass the same
explicit key to the stock layer (`nn.Dropout(...)(x, rng=key)`,
`nnx.Dropout(...)(x, rngs=key)`).

Everything is bitwise. The one declared difference is in the program: the
stock batch-norm layers lower differently (same numbers). The second pair,
the same classifier without batch norm, is its evidence: its programs are
identical.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from parity import KnownDifference, Pair, Renames, StockLinen, StockNnx
from models.families import ClassifierConfig, classifier_batch
from models.linen import classifier as linen_classifier
from models.nnx import classifier as nnx_classifier
from parity.pairs import adapter
from parity.run import compiling, runner
from tests import ema

CFG = ClassifierConfig()
RENAMES = Renames((
    ('Conv_0', 'conv1'), ('BatchNorm_0', 'bn1'), ('Conv_1', 'conv2'), ('BatchNorm_1', 'bn2'),
    ('Dropout_0', 'dropout'), ('Dense_0', 'head'),
))
BATCH_NORM_PROGRAM = KnownDifference(
    paths=('BatchNorm_0', 'BatchNorm_1'),
    passes=('program',),
    max_changed_lines=464,
    reason=(
        "flax's stock batch norm: Linen's _normalize expands the statistics with"
        ' jnp.expand_dims (broadcast_in_dim), NNX reshapes them (reshape), and the ops'
        ' that follow are ordered differently; same numbers, and without batch norm the'
        ' programs are identical (classifier_without_batch_norm)'
    ),
)


def make_sides(cfg, mesh):
  linen = StockLinen(
      functools.partial(linen_classifier.create_train_state, cfg),
      linen_classifier.train_step, linen_classifier.eval_step, linen_classifier.loss_fn,
      has_aux=True, mesh=mesh,
  )
  nnx_side = StockNnx(
      functools.partial(nnx_classifier.create_train_state, cfg),
      nnx_classifier.train_step, nnx_classifier.eval_step, nnx_classifier.loss_fn, mesh=mesh,
  )  # no renames: the kit infers them (RENAMES, tested below)
  return linen, nnx_side


classifier = Pair(
    'classifier',
    functools.partial(make_sides, CFG),
    functools.partial(classifier_batch, CFG),
    known_differences=(BATCH_NORM_PROGRAM,),
)

NO_BATCH_NORM = dataclasses.replace(CFG, batch_norm=False)
classifier_without_batch_norm = Pair(
    'classifier_without_batch_norm',
    functools.partial(make_sides, NO_BATCH_NORM),
    functools.partial(classifier_batch, NO_BATCH_NORM),
    parts=('grads', 'train', 'memory', 'program'),
)


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier')  # the pair's compiled steps are that group's
def test_a_declared_program_difference_covers_only_its_modules():
  """The runner (`parity compare --pair`) accepts a declared program difference only
  where the program is identical outside the declared modules: with the second batch
  norm left out of the declaration, the same run is not the same program."""
  only_first = dataclasses.replace(BATCH_NORM_PROGRAM, paths=('BatchNorm_0',))
  result = runner.compare_sides(
      adapter.make_pair_sides(classifier, None), lambda step: classifier.batch(step, 'train'), 1,
      declared_program_difference=only_first, localize_divergence=False,
  )
  assert result.bitwise_equal
  # The report counts the pair's parameters (the Linen state's `params`).
  linen = classifier.make_sides(None)[0]
  assert result.param_count == sum(math.prod(x.shape) for x in jax.tree.leaves(linen.template.params)) > 0
  assert result.program_diff.changed_lines <= only_first.max_changed_lines
  assert not result.program_diff_outside.identical
  assert result.expected_difference is None and not result.same_program
  assert 'outside the declared modules BatchNorm_0' in result.program_verdict


@pytest.mark.xdist_group('parity-classifier')
@pytest.mark.parametrize('paths,where', [
    (('BatchNorm_0', 'BatchNorm_1'), 'identical outside those modules: the declared modules changed more than the bound'),
    (('BatchNorm_0',), 'outside those modules too: programs differ'),
], ids=['inside_the_modules', 'outside_them_too'])
@pytest.mark.exhaustive
def test_a_program_over_its_declared_bound_says_where_it_differs(paths, where):
  """Over the bound, the failure says whether the declared modules alone changed more
  (a bound to revisit) or the program differs outside them as well (a bug to find)."""
  from parity.battery import checks as battery

  tight = dataclasses.replace(BATCH_NORM_PROGRAM, paths=paths, max_changed_lines=10)
  with pytest.raises(AssertionError, match='over|differ') as e:
    battery.check_program(dataclasses.replace(classifier, known_differences=(tight,)))
  assert f'(declared bound 10 lines in {", ".join(paths)}: ' in str(e.value)
  assert where in str(e.value).splitlines()[0], str(e.value).splitlines()[0]
  # Where they part: the batch norm's statistics expanded in Linen, reshaped in NNX (the
  # first differing line is a function's signature, whose result types come in another order).
  parting = [line for line in str(e.value).splitlines() if line.startswith('where they part')]
  assert 'stablehlo.broadcast_in_dim' in parting[0] and parting[0].startswith('where they part, Linen:')
  assert any(l.startswith('where they part, NNX:') and 'stablehlo.reshape' in l for l in parting), parting


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier')
@pytest.mark.parametrize('part,declared,message', [
    ('program', dataclasses.replace(BATCH_NORM_PROGRAM, max_changed_lines=5 * 464),
     "KnownDifference(('BatchNorm_0', 'BatchNorm_1'), 'program', max_changed_lines=2320) is loose:"
     ' the measured figure is '),
    ('memory', dataclasses.replace(BATCH_NORM_PROGRAM, passes=('program', 'memory'), max_temp_bytes=64),
     "nothing differs under it (the memory is the same on both sides): remove 'memory' from its passes"),
], ids=['program_loose', 'memory_vacuous'])
def test_a_program_or_memory_bound_must_be_tight(part, declared, message):
  """A declared program or memory bound is at most 4 times what is measured, and something
  differs under it: a bound with room to spare would hide a second difference in its modules."""
  from parity.battery import checks as battery

  check = {'program': battery.check_program, 'memory': battery.check_memory}[part]
  with pytest.raises(AssertionError) as failure:
    check(dataclasses.replace(classifier, known_differences=(declared,)))
  assert message in str(failure.value), failure.value


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier_without_batch_norm')
def test_a_program_declared_where_nothing_differs_is_refused():
  from parity.battery import checks as battery

  declared = dataclasses.replace(BATCH_NORM_PROGRAM, paths=('Conv_0',))
  with pytest.raises(AssertionError) as failure:
    battery.check_program(dataclasses.replace(classifier_without_batch_norm, known_differences=(declared,)))
  assert "nothing differs under it (the program is the same on both sides): remove 'program'" in str(
      failure.value), failure.value


@pytest.mark.xdist_group('parity-classifier')
def test_the_memory_check_fails_when_nothing_is_measured(monkeypatch):
  """A backend without XLA's memory analysis gives no fields: the check says so, never passes."""
  from parity.battery import checks as battery

  battery.check_memory(classifier)  # measured here: passes
  monkeypatch.setattr(compiling, 'memory_of', lambda executable, device: {})
  with pytest.raises(AssertionError, match='memory analysis not measured'):
    battery.check_memory(classifier)


def test_a_mesh_of_another_device_count_says_how_to_get_the_devices(monkeypatch):
  from parity.battery import checks as battery

  with pytest.raises(ValueError, match=r"needs 4 devices, but 8 are available\. .*device_count=N") as e:
    battery._Runs(classifier).sides('data=4')
  assert 'default backend' not in str(e.value)
  # On an accelerator host (seen on a one-GPU host: the plugin's data=8 against 1 device),
  # the CPU's flag alone would not help: it says how to run on the CPU, or on those devices.
  monkeypatch.setattr(battery.shared.jax, 'default_backend', lambda: 'gpu')
  with pytest.raises(ValueError, match=r"default backend here is gpu: JAX_PLATFORMS=cpu runs the"
                                       r" battery on the CPU devices, or --parity-mesh"):
    battery._Runs(classifier).sides('data=4')
  with pytest.raises(ValueError, match=r"^bad mesh spec 'data'"):  # not a device count: its own message
    battery._Runs(classifier).sides('data')


def test_a_declared_ulp_bound_does_not_cover_integers():
  """A declared difference bounds float values in ULP; an integer leaf that differs is a
  failure naming it, not a crash of the ULP measure."""
  import numpy as np

  from parity.battery import checks as battery

  declared = KnownDifference(('count', 'w'), ('train',), 'test', max_ulp=4, substitute=classifier.make_sides)
  pair = dataclasses.replace(classifier, known_differences=(declared,))
  a = {'count': np.int32(3), 'w': np.float32(1.0)}
  b = {'count': np.int32(4), 'w': np.nextafter(np.float32(1.0), np.float32(2.0))}
  with pytest.raises(AssertionError, match=r'count: .*declared bound 4 ULP, but these are not floats'):
    battery.compare(pair, 'train', a, b, 'final states')
  assert battery.compare(pair, 'train', {'w': a['w']}, {'w': b['w']}, 'final states') == [
      'w: 1 ULP (declared bound 4, measured maximum 1 ULP: test)'
  ]


@pytest.mark.parametrize('declared,message', [
    (dict(paths=('w',), max_ulp=4), 'has no substitution: a value bound is accepted only with `substitute=`'),
    (dict(paths=('w',), max_ulp=5, substitute=True), 'is loose: the measured maximum is 1 ULP; declare max_ulp=1'),
    (dict(paths=('params/*',), max_ulp=4, substitute=True), "covers a whole collection (params/*)"),
    (dict(paths=('v',), max_ulp=4, substitute=True), 'nothing differs under it (measured maximum 0 ULP)'),
], ids=['unproven', 'loose', 'global', 'vacuous'])
def test_a_value_bound_must_be_proven_tight_and_a_modules(declared, message):
  import numpy as np

  from parity.battery import checks as battery

  if declared.pop('substitute', False):
    declared['substitute'] = classifier.make_sides
  pair = dataclasses.replace(classifier, known_differences=(KnownDifference(passes=('train',), reason='test', **declared),))
  w = np.float32(1.0)
  with pytest.raises(AssertionError) as e:
    battery.compare(pair, 'train', {'w': w}, {'w': np.nextafter(w, np.float32(2.0))}, 'final states')
  assert message in str(e.value), str(e.value)


@pytest.mark.xdist_group('parity-classifier')
def test_a_global_bound_on_a_bitwise_pair_fails_naming_the_measured_maximum():
  """`params/*` with a million ULP on a pair whose gradients are bit-identical: refused, with 0."""
  from parity.battery import checks as battery

  vacuous = KnownDifference(('params/*',), ('grads',), 'everything', max_ulp=10**6)
  pair = dataclasses.replace(classifier, known_differences=classifier.known_differences + (vacuous,))
  with pytest.raises(AssertionError) as e:
    battery.check_grads(pair)
  message = str(e.value)
  assert "covers a whole collection (params/*)" in message and 'measured maximum here: 0 ULP' in message, message
  assert 'nothing differs under it (measured maximum 0 ULP)' in message


def test_a_differing_scalar_is_listed_before_the_arrays_it_explains():
  """A step counter that differs moves every parameter after it: the failure lists leaves
  missing on a side first, then scalars, then arrays, so the counter is seen even when
  more arrays differ than the message shows (50)."""
  import numpy as np

  from parity.battery import checks as battery

  a = {f'params/layer_{i:02d}/w': np.zeros(3, np.float32) for i in range(60)}
  b = {k: np.ones(3, np.float32) for k in a}
  a['step'], b['step'] = np.int32(3), np.int32(4)
  a['zz_only_linen'] = np.float32(0)
  with pytest.raises(AssertionError) as e:
    battery.compare(classifier, 'train', a, b, 'final states')
  lines = str(e.value).splitlines()
  assert '62 leaf/leaves differ, scalars first' in lines[0], lines[0]
  assert lines[1].strip().startswith('zz_only_linen: missing'), lines[1]
  assert lines[2].strip().startswith('step: bits: int32[]: 1 of 1 elements differ'), lines[2]
  assert lines[3].strip().startswith('params/layer_00/w: bits'), lines[3]
  assert lines[-1].strip() == '... and 12 more'


@pytest.mark.xdist_group('parity-classifier')
def test_parameters_flattened_in_one_order_get_no_order_hint():
  """conv1, bn1, ... sort as Conv_0, BatchNorm_0, ... do: nothing to say."""
  from parity.battery import checks as battery

  assert battery._runs(classifier).parameter_order_lines() == []


def test_a_batch_the_mesh_cannot_split_is_a_clear_error():
  """A batch of 6 rows on `data=8`: the error names the entry, its rows and the ways out,
  before jax's own error from inside device_put."""
  from parity.core import specs
  from parity.pairs.adapter import BatchError

  linen, nnx_side = make_sides(CFG, specs.make_mesh('data=8'))
  batch = {k: v[:6] for k, v in classifier_batch(CFG, 0, 'train').items()}
  for side in (linen, nnx_side):
    with pytest.raises(BatchError, match=r"batch entry 'images' \(float32\[6, .*\) has 6 rows: the mesh's"
                                         r" 'data' axis splits the batch over 8 devices, evenly only"):
      side.place_batch(batch)
  full = classifier_batch(CFG, 0, 'train')  # 8 rows: placed, one row per device
  assert {k: v.sharding.shard_shape(v.shape)[0] for k, v in linen.place_batch(full).items()} == dict.fromkeys(full, 1)


def test_a_structure_mismatch_is_a_failure_naming_every_path():
  """A rename rule missing (the head): the structure part fails as an assertion, naming the
  paths on both sides, not with the bridge's TreeMismatchError from inside the tool."""
  from parity.battery import checks as battery

  def make_broken(mesh):
    linen, nnx_side = make_sides(CFG, mesh)
    rules = tuple(r for r in RENAMES.rules if r[0] != 'Dense_0')
    return linen, dataclasses.replace(nnx_side, renames=Renames(rules), infer_renames=False)

  broken = Pair('missing_rename', make_broken, functools.partial(classifier_batch, CFG))
  with pytest.raises(AssertionError) as e:
    battery.check_structure(broken)
  message = str(e.value)
  assert message.startswith('missing_rename: NNX state vs Linen state (checkpoint layout):')
  assert 'params/Dense_0/kernel: missing' in message and 'params/head/kernel: extra' in message


class _Counted:
  """A side whose train step also returns a step counter of `dtype` (outside its compiled step)."""

  def __init__(self, side, dtype):
    self._side, self._dtype = side, dtype

  def __getattr__(self, name):
    return getattr(self._side, name)

  def train_step(self, state, batch, dropout_base):
    import numpy as np

    state, metrics = self._side.train_step(state, batch, dropout_base)
    return state, {**metrics, 'seen': np.asarray(1, self._dtype)}


def test_a_metric_returned_as_another_dtype_is_not_blamed_on_the_update():
  """Linen's step counter is int32, nnx.Optimizer's uint32: a counter returned as a metric
  differs in dtype with equal numbers. The localizer, finding both passes bitwise, says
  so, instead of pointing at the optimizer update."""
  from parity.battery import checks as battery

  def make_counted(mesh):
    linen, nnx_side = make_sides(CFG, mesh)
    return _Counted(linen, 'int32'), _Counted(nnx_side, 'uint32')

  counted = Pair('counted', make_counted, functools.partial(classifier_batch, CFG))
  with pytest.raises(AssertionError) as e:
    battery.check_train(counted, 'linen')
  message = str(e.value)
  assert 'seen/step_0: dtype: int32 vs uint32' in message, message
  assert ('the train metrics of step 0 differ in type only (seen: dtype: int32 vs uint32): the two'
          ' train steps return a metric as another dtype') in message, message
  assert 'optimizer update' not in message


def test_another_initialiser_fails_the_init_part():
  """NNX's head initialised 4 times larger (a lost 1/sqrt(fan_in)) and its bias with ones:
  both named, the kernel by its distribution, the bias bit for bit (it is constant)."""
  from parity.battery import checks as battery

  def make_misinitialised(mesh):
    linen, nnx_side = make_sides(CFG, mesh)

    def create(seed):
      model, optimizer = nnx_classifier.create_train_state(CFG, seed)
      model.head.kernel[...] = model.head.kernel[...] * 4
      model.head.bias[...] = model.head.bias[...] + 1
      return model, optimizer

    return linen, dataclasses.replace(nnx_side, create=create)

  pair = Pair('misinitialised', make_misinitialised, functools.partial(classifier_batch, CFG))
  with pytest.raises(AssertionError) as e:
    battery.check_init(pair)
  message = str(e.value)
  assert message.startswith(
      "misinitialised: the two sides' own initial states (init(seed 0), checkpoint layout) differ"
      ' beyond what their random initialisers explain: 2 leaf/leaves (values: Linen vs NNX)'), message
  lines = message.splitlines()[1:]
  assert [line.split(':')[0].strip() for line in lines] == ['params/Dense_0/bias', 'params/Dense_0/kernel']
  assert lines[0].endswith('(not random in Linen and NNX: all its elements equal, or not floats, so compared'
                           ' bit for bit)'), lines[0]
  assert 'another distribution' in lines[1] and 'std ratio within 1 +- 0.474' in lines[1], lines[1]
  battery.check_init(classifier)  # the pair itself passes


def test_an_optimizer_holding_more_than_the_stock_one_is_named_once():
  """An nnx.Optimizer with EMA copies of two parameters: one problem naming the attribute,
  its leaf count and the way on, not a contradiction per leaf ("optimizer (1/...) leaf,
  got other")."""
  import jax.numpy as jnp
  from flax import nnx

  from parity.pairs import stock_layout as stock
  from parity.core.errors import TreeMismatchError

  model, optimizer = nnx_classifier.create_train_state(CFG, 0)
  optimizer.ema = nnx.data({'head': nnx.Variable(jnp.zeros(2)), 'conv1': nnx.Variable(jnp.ones(2))})
  with pytest.raises(TreeMismatchError) as e:
    stock.nnx_to_checkpoint(nnx.state((model, optimizer)), RENAMES)
  assert str(e.value) == (
      'NNX train state: 1 path(s) do not match:\n  1/ema/conv1: extra: expected a model leaf (0/...)'
      " or nnx.Optimizer's step (1/step) or opt_state (1/opt_state/...), got 1/ema (2 leaves): the"
      ' stock NNX side carries those alone; an optimizer attribute holding more, such as EMA copies'
      ' of the parameters or a loss scale, is declared with the train-state field it is stored in'
      " (StockNnx(optimizer_fields=(('ema', '<the TrainState field>'),))); other state needs a side"
      ' of its own (parity.pairs.adapter.Side)')


def _ema_sides(mesh, fields=ema.FIELDS):
  return ema.sides(linen_classifier, nnx_classifier, CFG, mesh, renames=RENAMES, has_aux=True,
                   fields=fields)


@pytest.mark.exhaustive
def test_an_optimizer_attribute_declared_with_its_field_is_carried_bit_for_bit():
  """The EMA crosses between the sides as `ema_params/<Linen path>` (renamed like the
  parameters), both ways, and two steps from either side's start agree bit for bit,
  the EMA included, as does an eval of the EMA (the NNX eval step given the optimizer);
  declared under another field, the structures differ by it."""
  from parity.battery import checks as battery

  pair = Pair('ema', _ema_sides, functools.partial(classifier_batch, CFG), steps=2)
  battery.check_structure(pair)
  linen, _ = _ema_sides(None)
  start = linen.to_checkpoint(linen.init(0))
  assert 'ema_params/Conv_0/kernel' in start and 'ema_params/BatchNorm_0/scale' in start
  battery.check_train(pair, 'linen')
  battery.check_train(pair, 'nnx')
  battery.check_eval(pair)
  misnamed = Pair('misnamed', functools.partial(_ema_sides, fields=(('ema', 'ema'),)),
                  functools.partial(classifier_batch, CFG))
  with pytest.raises(AssertionError, match=r'ema/Conv_0/kernel'):
    battery.check_structure(misnamed)


# A dynamic loss scale (flax.training.dynamic_scale.DynamicScale, the mixed-precision idiom
# of flax's ImageNet example) beside the classifier's train state: a TrainState field on
# the Linen side, the same object as an nnx.Optimizer attribute on the NNX side. It does
# not mirror the parameters: a scalar scale and a count of finite steps. Step 0's batch
# holds an infinite pixel, so its gradients are not finite: both sides keep their
# parameters, moments and batch statistics and halve the scale; later steps apply, and
# the second finite step in a row doubles it again (growth_interval=1).
FIRST_SCALE = 2.0**15


def _scaled_batch(step, split='train'):
  batch = classifier_batch(CFG, step, split)
  if (step, split) == (0, 'train'):
    batch['images'][0, 0, 0, 0] = np.inf
  return batch


def _dynamic_scale():
  import jax.numpy as jnp
  from flax.training.dynamic_scale import DynamicScale

  return DynamicScale(growth_interval=1, fin_steps=jnp.int32(0), scale=jnp.float32(FIRST_SCALE))


@functools.cache
def _scaled_linen_steps():
  import jax.numpy as jnp

  from models import rng

  class ScaledTrainState(linen_classifier.TrainState):
    dynamic_scale: object = None

  def create(seed):
    return ema.extended(linen_classifier.create_train_state(CFG, seed), ScaledTrainState,
                        dynamic_scale=_dynamic_scale())

  @jax.jit
  def train_step(state, batch, dropout_base):
    key = rng.step_key(dropout_base, state.step, 0)
    grad_fn = state.dynamic_scale.value_and_grad(linen_classifier.loss_fn, has_aux=True)
    dynamic_scale, finite, (loss, batch_stats), grads = grad_fn(state.params, state, batch, key)
    new = state.apply_gradients(grads=grads)
    keep = functools.partial(jnp.where, finite)
    new = new.replace(params=jax.tree.map(keep, new.params, state.params),
                      opt_state=jax.tree.map(keep, new.opt_state, state.opt_state),
                      batch_stats=jax.tree.map(keep, batch_stats, state.batch_stats),
                      dynamic_scale=dynamic_scale)
    return new, {'loss': loss, 'finite': finite}

  return create, train_step, linen_classifier.eval_step


@functools.cache
def _scaled_nnx_steps():
  import jax.numpy as jnp
  from flax import nnx

  from models import rng

  def create(seed):
    model, optimizer = nnx_classifier.create_train_state(CFG, seed)
    optimizer.dynamic_scale = nnx.data(_dynamic_scale())
    return model, optimizer

  @nnx.jit
  def train_step(model, optimizer, batch, dropout_base):
    key = rng.step_key(dropout_base, optimizer.step[...], 0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
      scaled = nnx.merge(graphdef, params, rest, copy=True)  # its own variables, in this trace
      return nnx_classifier.loss_fn(scaled, batch, key), nnx.state(scaled, nnx.BatchStat)

    grad_fn = optimizer.dynamic_scale.value_and_grad(loss, has_aux=True)
    dynamic_scale, finite, (loss, batch_stats), grads = grad_fn(params)
    updated = (nnx.state(model, (nnx.Param, nnx.BatchStat)), optimizer.opt_state)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    old = jax.tree.map(lambda v: v[...], updated, is_leaf=is_variable)
    optimizer.update(model, grads)
    nnx.update(model, batch_stats)
    jax.tree.map(lambda v, o: v.__setitem__(..., jnp.where(finite, v[...], o)), updated, old,
                 is_leaf=is_variable)
    optimizer.dynamic_scale = dynamic_scale
    return {'loss': loss, 'finite': finite}

  return create, train_step, nnx_classifier.eval_step


def _scaled_sides(mesh, fields=(('dynamic_scale', 'dynamic_scale'),)):
  create, train_step, eval_step = _scaled_linen_steps()
  linen = StockLinen(create, train_step, eval_step, linen_classifier.loss_fn, has_aux=True, mesh=mesh)
  create, train_step, eval_step = _scaled_nnx_steps()
  nnx_side = StockNnx(create, train_step, eval_step, nnx_classifier.loss_fn, renames=RENAMES,
                      mesh=mesh, optimizer_fields=fields)
  return linen, nnx_side


@pytest.mark.exhaustive
def test_optimizer_state_that_does_not_mirror_the_parameters_is_carried_bit_for_bit():
  """flax's DynamicScale in the optimizer: `1/dynamic_scale/scale` crosses as the
  TrainState's `dynamic_scale/scale`, both ways; four steps from either side's start,
  the first skipped for its infinite gradients, agree bit for bit, scale and count
  included, and so do a checkpoint round trip into the other side and a resume there."""
  from parity.battery import checks as battery

  pair = Pair('dynamic_scale', _scaled_sides, _scaled_batch, steps=4)
  battery.check_structure(pair)
  _, nnx_side = _scaled_sides(None)
  start = nnx_side.to_checkpoint(nnx_side.init(0))
  assert float(start['dynamic_scale/scale']) == FIRST_SCALE and int(start['dynamic_scale/fin_steps']) == 0
  battery.check_train(pair, 'linen')
  battery.check_train(pair, 'nnx')
  battery.check_checkpoint(pair, 'nnx->linen')
  battery.check_resume(pair, 'linen->nnx')
  # The premise: step 0 was skipped (halving the scale), step 2 doubled it, step 3 counted.
  metrics, final, _ = battery._runs(pair).trajectory('nnx', 'nnx')
  assert [bool(m['finite']) for m in metrics] == [False, True, True, True]
  assert (float(final['dynamic_scale/scale']), int(final['dynamic_scale/fin_steps'])) == (FIRST_SCALE, 1)
  assert not np.array_equal(final['params/Conv_0/kernel'], start['params/Conv_0/kernel'])
  misnamed = Pair('misnamed', functools.partial(_scaled_sides, fields=(('dynamic_scale', 'loss_scale'),)),
                  _scaled_batch)
  with pytest.raises(AssertionError, match=r'loss_scale/scale'):
    battery.check_structure(misnamed)


def _stream_sides(mesh):
  """The classifier, its NNX dropout layer keeping an RNG stream (`nnx.Dropout(rate, rngs=...)`,
  as flax's NNX examples make it); the family's step still passes the step's key at the call."""
  from flax import nnx

  linen, nnx_side = make_sides(CFG, mesh)

  def create(seed):
    model, optimizer = nnx_classifier.create_train_state(CFG, seed)
    model.dropout = nnx.Dropout(CFG.dropout_rate, rngs=nnx.Rngs(dropout=seed))
    return model, optimizer

  return linen, dataclasses.replace(nnx_side, create=create)


class _OnBatchStatistics(nnx.BatchNorm):
  """An nnx.BatchNorm that normalises with the batch's statistics whatever it is told (the bug):
  in train mode as asked, in eval mode not."""

  def __call__(self, x, use_running_average=None, **kwargs):
    return super().__call__(x, use_running_average=False, **kwargs)


def _eval_pair(name: str, nnx_cfg=None, eval_scale: float | None = None, batch_stats_in_eval: bool = False) -> Pair:
  """The classifier with its NNX side changed: another config (`nnx_cfg`), an eval step whose
  loss is scaled by `eval_scale`, or one whose batch norms normalise with the batch's
  statistics (`batch_stats_in_eval`); one train step."""
  def sides(mesh):
    linen, nnx_side = make_sides(CFG, mesh)
    if nnx_cfg is not None:
      nnx_side = dataclasses.replace(nnx_side, create=functools.partial(nnx_classifier.create_train_state, nnx_cfg))
    if eval_scale is not None:
      def eval_step(model, batch):
        metrics = nnx_classifier.eval_step(model, batch)
        return {**metrics, 'loss': metrics['loss'] * eval_scale}
      nnx_side = dataclasses.replace(nnx_side, eval_step_fn=eval_step)
    if batch_stats_in_eval:
      def create(seed):
        model, optimizer = nnx_classifier.create_train_state(CFG, seed)
        model.bn1.__class__ = model.bn2.__class__ = _OnBatchStatistics  # the same state, the bug's class
        return model, optimizer
      nnx_side = dataclasses.replace(nnx_side, create=create)
    return linen, nnx_side

  return Pair(name, sides, functools.partial(classifier_batch, CFG), steps=1, parts=('eval',))


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier')
def test_the_eval_part_compares_the_eval_steps_from_one_state_first():
  """An eval step that differs fails from one state, whatever the training did; a train step
  that differs (another dropout rate: eval has dropout off) leaves the eval steps equal from
  one state, and the eval part says the trained states differ instead."""
  from parity.battery import checks as battery

  with pytest.raises(AssertionError, match=r"eval_differs: eval metrics from one state \(the Linen run's after 1"
                     r' steps\) are not bit-identical: 1 leaf/leaves differ[\s\S]*\bloss: bits'):
    battery.check_eval(_eval_pair('eval_differs', eval_scale=1.5))
  with pytest.raises(AssertionError, match=r"train_differs: eval metrics after each side's own training \(the"
                     r' eval steps agree from one state: the trained states differ, see the train part\)'):
    battery.check_eval(_eval_pair('train_differs', nnx_cfg=dataclasses.replace(CFG, dropout_rate=0.2)))


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier')
def test_the_eval_localizer_names_a_batch_norm_on_the_batch_statistics_in_eval_mode():
  """NNX's eval step normalises with the batch's statistics (a `use_running_average` left off in
  eval mode): the eval localizer names the first batch norm, and says what eval mode asks of it."""
  from parity.battery import checks as battery

  with pytest.raises(AssertionError) as failure:
    battery.check_eval(_eval_pair('batch_stats_in_eval', batch_stats_in_eval=True))
  message = str(failure.value)
  assert message.startswith("batch_stats_in_eval: eval"), message
  assert "from one state (the Linen run's after 1 steps) are not bit-identical" in message.splitlines()[0], message
  assert '\n  eval localizer: first differs at module BatchNorm_0 (NNX: bn1), run eagerly in eval mode (' in message, message
  assert ('\n  BatchNorm_0: a batch norm: in eval mode both sides normalise with its running averages'
          in message), message


class _ScaledGrads:
  """A side whose `value_and_grads` scales its gradients by 2 (its probe is the side's own)."""

  def __init__(self, side):
    self._side = side

  def __getattr__(self, name):
    return getattr(self._side, name)

  def value_and_grads(self, state, batch, dropout_key):
    loss, grads = self._side.value_and_grads(state, batch, dropout_key)
    return loss, {p: g * 2 for p, g in grads.items()}


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier')
def test_a_grads_failure_whose_probes_agree_blames_value_and_grads_not_the_update():
  """The grads part has no update: when both probes agree, what differs is the sides'
  `value_and_grads` themselves, and the localizer says so."""
  from parity.battery import checks as battery

  def sides(mesh):
    linen, nnx_side = make_sides(CFG, mesh)
    return linen, _ScaledGrads(nnx_side)

  pair = Pair('scaled_grads', sides, functools.partial(classifier_batch, CFG), parts=('grads',))
  with pytest.raises(AssertionError) as failure:
    battery.check_grads(pair)
  message = str(failure.value)
  assert "both passes are bitwise from the same state (each side's probe): so the sides' value_and_grads" in message
  assert 'optimizer update' not in message, message


def test_every_part_that_runs_a_state_stops_at_a_structure_that_differs():
  """A rename rule left out: the structure part names every path, and the parts that carry a
  state across say so in one message instead of failing inside the sides' own code."""
  from parity.pairs.stock_layout import Renames
  from parity.battery import checks as battery

  def sides(mesh):
    linen, nnx_side = make_sides(CFG, mesh)
    rules = tuple(r for r in RENAMES.rules if r[0] != 'Dense_0')
    return linen, dataclasses.replace(nnx_side, renames=Renames(rules), infer_renames=False)

  pair = Pair('renamed', sides, functools.partial(classifier_batch, CFG))
  with pytest.raises(AssertionError, match=r'params/Dense_0/kernel: missing'):
    battery.check_structure(pair)
  for check in (lambda: battery.check_train(pair, 'nnx'), lambda: battery.check_grads(pair),
                lambda: battery.check_checkpoint(pair, 'linen->nnx'), lambda: battery.check_eval(pair)):
    with pytest.raises(AssertionError, match=r"renamed: the two sides' states differ in the checkpoint layout,"
                       r' so nothing is compared here \(the structure part names every path\)'):
      check()


def _drawing_sides(mesh):
  """`_stream_sides`, the dropout drawing from its stream: the key passed at the call is ignored,
  as a model written with flax's NNX idiom (`self.dropout(x)`) has it."""
  from flax import nnx

  class StreamDropout(nnx.Dropout):
    def __call__(self, inputs, *, deterministic=None, rngs=None):
      del rngs
      return super().__call__(inputs, deterministic=deterministic)

  linen, nnx_side = make_sides(CFG, mesh)

  def create(seed):
    model, optimizer = nnx_classifier.create_train_state(CFG, seed)
    model.dropout = StreamDropout(CFG.dropout_rate, rngs=nnx.Rngs(dropout=seed))
    return model, optimizer

  return linen, dataclasses.replace(nnx_side, create=create)


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier')
def test_a_dropout_drawing_from_a_stream_kept_in_the_nnx_model_is_named_with_the_fix():
  """Stock dropout on both sides, NNX's drawing from its stream: the masks differ from the
  first step; the localizer names the dropout module by both sides' paths, and says that it
  draws from a stream Linen has not and that Linen's keys make the masks equal."""
  from parity.battery import checks as battery

  pair = Pair('rng_stream_drawn', _drawing_sides, functools.partial(classifier_batch, CFG),
              known_differences=(BATCH_NORM_PROGRAM,), parts=('structure', 'grads'))
  battery.check_structure(pair)
  with pytest.raises(AssertionError) as failure:
    battery.check_grads(pair)
  message = str(failure.value)
  assert "forward pass: first differs at module Dropout_0" in message, message
  assert ('Dropout_0 (NNX dropout) draws its dropout mask from an RNG stream the NNX model keeps'
          ' (dropout/rngs)') in message, message
  assert "StockNnx(..., dropout_keys='linen') seeds the streams the model keeps" in message, message
  # The family's own pair, whose NNX dropout keeps no stream, gets no such line.
  _, plain = adapter.make_pair_sides(classifier, None)
  streams = Pair('rng_stream', _stream_sides, functools.partial(classifier_batch, CFG))
  assert plain.rng_stream_paths() == [] and adapter.make_pair_sides(streams, None)[1].rng_stream_paths() == [
      'Dropout_0/rngs/count', 'Dropout_0/rngs/key']


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-classifier')
def test_an_rng_stream_kept_in_the_nnx_model_is_carried_outside_the_comparison():
  """`StockNnx(nnx_only=(nnx.RngState,))`, the default: the stream (`RngKey`, `RngCount`) is in
  the NNX state and its programs but in no checkpoint, so the numbers compare bit for bit;
  a state made from a checkpoint takes it as `create(0)` makes it. Memory is accounted (its
  12 bytes of threefry key and count off NNX's arguments and outputs), the program and the
  mesh's annotations compared without it."""
  from parity.core import paths
  from parity.battery import checks as battery
  from parity.core.bitwise import assert_bitwise_equal

  pair = Pair('rng_stream', _stream_sides, functools.partial(classifier_batch, CFG),
              known_differences=(BATCH_NORM_PROGRAM,))
  battery.check_structure(pair)
  _, nnx_side = _stream_sides(None)
  state = nnx_side.init(0)
  stream = sorted(p for p in paths.flatten(state) if '/rngs/' in p)
  assert stream == ['0/dropout/rngs/count', '0/dropout/rngs/key'], stream
  assert not [p for p in nnx_side.to_checkpoint(state) if 'rngs' in p]
  assert_bitwise_equal(nnx_side.from_checkpoint(nnx_side.to_checkpoint(state)), state, 'init(0) carried back')
  battery.check_train(pair, 'nnx')
  battery.check_checkpoint(pair, 'nnx->linen')
  battery.check_resume(pair, 'linen->nnx')
  # The stream's bytes: its key data (2 uint32 for jax's default threefry keys) and its count.
  stream_bytes = sum(np.asarray(jax.random.key_data(x) if '/key' in p else x).nbytes
                     for p, x in paths.flatten(state).items() if p in stream)
  # Declared state only NNX keeps is accounted, not a difference: memory equal with NNX's step
  # compiled without it, as the program is compared (unused here: the step's key is passed at the
  # call), the line saying what it adds to the step that carries it; its placement on the mesh
  # checked apart.
  (line,) = battery.check_memory(pair)
  assert line.startswith(f'state only NNX keeps (2 leaves, {stream_bytes} B: 0/dropout/rngs/count,'
                         f" 0/dropout/rngs/key): NNX's step compared without it, as the program part"
                         f' compares it (it adds argument_bytes +{stream_bytes} B'), line
  battery.check_program(pair)
  battery.check_mesh(pair, 'data=8')
