"""The divergence localizer names the module and the pass where two sides part.

Two tiny stock MLPs (nn.Dense / nnx.Linear, tanh); the NNX side is broken on
purpose in one module at a time: its forward pass (a bias added), or only its
backward pass (a custom VJP that scales the kernel's gradient). The
localizer must name that module and that pass, and nothing when unbroken.
"""
from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

from parity.pairs.stock_layout import Renames
from parity.compare import localize
from parity.pairs.stock import StockLinen, StockNnx

FEATURES = (8, 8, 4)


class LinenMlp(nn.Module):
  remat: bool = False  # the hidden layers under nn.remat

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(FEATURES):
      dense = nn.remat(nn.Dense) if self.remat and i < len(FEATURES) - 1 else nn.Dense
      x = dense(f, name=f'dense_{i}')(x)
      x = jnp.tanh(x) if i < len(FEATURES) - 1 else x
    return x


@jax.custom_vjp
def _grad_scaled(w):
  return w


_grad_scaled.defvjp(lambda w: (w, None), lambda _, g: (g * 1.0001,))


class BrokenLinear(nnx.Linear):
  """nnx.Linear, broken in the forward (a bias offset), only the backward (a scaled
  kernel gradient), or in its output's dtype (bfloat16, as a wrong `dtype=` gives)."""

  def __init__(self, *args, mode: str, **kwargs):
    super().__init__(*args, **kwargs)
    self.mode = mode

  def __call__(self, x):
    if self.mode == 'backward':
      return x @ _grad_scaled(self.kernel[...]) + self.bias[...]
    if self.mode == 'dtype':
      return super().__call__(x).astype(jnp.bfloat16)
    return super().__call__(x) + 1e-3


class NnxMlp(nnx.Module):
  def __init__(self, broken: tuple[int, str] | dict[int, str] | None, rngs: nnx.Rngs, remat: bool = False):
    """`broken`: (layer, mode), or {layer: mode} for several; `remat`: the hidden layers
    called through nnx.remat."""
    self.remat = remat
    breaks = dict([broken]) if isinstance(broken, tuple) else dict(broken or {})
    sizes = (6,) + FEATURES
    layers = []
    for i in range(len(FEATURES)):
      if i in breaks:
        layers.append(BrokenLinear(sizes[i], sizes[i + 1], mode=breaks[i], rngs=rngs))
      else:
        layers.append(nnx.Linear(sizes[i], sizes[i + 1], rngs=rngs))
    self.layers = nnx.List(layers)

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      hidden = i < len(FEATURES) - 1
      x = nnx.remat(lambda m, x: m(x))(layer, x) if self.remat and hidden else layer(x)
      x = jnp.tanh(x) if hidden else x
    return x


def _linen_side(remat=False):
  def create(seed):
    model = LinenMlp(remat)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 6)))['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

  def loss(params, state, batch, key):
    return jnp.mean(jnp.square(state.apply_fn({'params': params}, batch['x']) - batch['y']))

  return StockLinen(create, None, None, loss)


def _nnx_side(broken, remat=False):
  def create(seed):
    model = NnxMlp(broken, nnx.Rngs(params=seed), remat)
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  def loss(model, batch, key):
    return jnp.mean(jnp.square(model(batch['x']) - batch['y']))

  renames = Renames(tuple((f'dense_{i}', f'layers/{i}') for i in range(len(FEATURES))))
  return StockNnx(create, None, None, loss, renames=renames)


def _localize(broken, remat=False):
  linen, nnx_side = _linen_side(remat), _nnx_side(broken, remat)
  state = linen.init(0)
  batch = {
      'x': jax.random.normal(jax.random.PRNGKey(1), (5, 6)),
      'y': jax.random.normal(jax.random.PRNGKey(2), (5, 4)),
  }
  key = jax.random.PRNGKey(3)
  nnx_state = nnx_side.from_checkpoint(linen.to_checkpoint(state))
  return localize.localize(linen.probe(state, batch, key), nnx_side.probe(nnx_state, batch, key))


def test_equal_sides_localize_nothing():
  result = _localize(None)
  assert result.clean, result.lines()
  assert result.lines() == [
      'forward pass: every module output bitwise equal',
      'backward pass: every parameter gradient bitwise equal',
  ]


@pytest.mark.parametrize('layer', [0, 1, 2])
def test_a_forward_break_is_named_at_its_module(layer):
  result = _localize((layer, 'forward'))
  assert result.forward == f'dense_{layer}' and not result.forward_inside, result.lines()
  assert result.lines()[0].startswith(f'forward pass: first differs at module dense_{layer} ')


@pytest.mark.parametrize('layer', [0, 1, 2])
def test_a_backward_only_break_is_named_at_its_module(layer):
  result = _localize((layer, 'backward'))
  assert result.forward is None, result.lines()
  assert result.backward == [(f'dense_{layer}', [f'params/dense_{layer}/kernel'])], result.lines()
  assert result.lines()[1].startswith(
      f'backward pass: inside module dense_{layer} (NNX: layers/{layer}): output cotangent bitwise equal,'
      f' gradients differ: params/dense_{layer}/kernel'
  )


def test_a_dtype_break_is_named_without_a_ulp_distance():
  """A bfloat16 output against float32: the module is named; ULPs between two dtypes mean nothing."""
  result = _localize((1, 'dtype'))
  assert result.forward == 'dense_1' and not result.forward_inside, result.lines()
  assert result.details['dense_1'] == 'float32 vs bfloat16', result.details
  first = result.first(0)
  assert (first['path'], first['pass'], first['max_ulp']) == ('dense_1', 'forward', None)


def test_backward_breaks_at_one_depth_are_named_in_the_backward_pass_order():
  """Two modules of one depth with differing gradients: the one the backward pass runs first
  (the later in the forward) comes first, on every run (not in a set's hash order)."""
  result = _localize({0: 'backward', 2: 'backward'})
  assert [m for m, _ in result.backward] == ['dense_2', 'dense_0'], result.lines()
  assert result.first(0)['path'] == 'dense_2'


def test_module_calls_in_another_order_are_named():
  """A rename rule that maps an NNX module to another Linen path (two layer norms swapped)
  shows as calls in another order; the same order says nothing."""
  from parity.pairs import adapter

  def probe(order):
    return adapter.Probe(order=order, inputs={}, outputs={k: jnp.zeros(3) for k in order},
                         cotangents={}, param_grads={})

  result = localize.localize(probe(['a', 'b', 'c', 'd']), probe(['a', 'c', 'b', 'd']))
  assert result.order_difference == (1, 'b', 'c')
  assert ('module calls in another order: call 1 of those on both sides is b in Linen, c in NNX'
          in '\n'.join(result.lines()))
  same = localize.localize(probe(['a', 'b', 'c', 'd']), probe(['a', 'b', 'c', 'd']))
  assert same.order_difference is None and not any('order' in line for line in same.lines())


class _ScannedBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(8)(x)), None


class LinenScannedMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name='inp')(x)
    stack = nn.scan(_ScannedBlock, variable_axes={'params': 0}, split_rngs={'params': True}, length=3)
    x, _ = stack(name='blocks')(x, None)
    return nn.Dense(4, name='head')(x)


def test_a_linen_scanned_stack_is_probed_around_its_body():
  """Module calls inside an nn.scan body are the body's tracers: recording them crashed the
  probe (UnexpectedTracerError). They are listed as not recorded; the calls around the
  stack and every gradient, the stack's too, are compared."""
  model = LinenScannedMlp()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 6)))['params']
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

  def loss(params, state, batch, key):
    return jnp.mean(jnp.square(state.apply_fn({'params': params}, batch['x'])))

  probe = localize.linen_probe(loss, False, state, {'x': jnp.ones((5, 6))}, jax.random.PRNGKey(1))
  assert probe.order == ['inp', 'head', localize.ROOT]
  assert probe.unrecorded == ('blocks/Dense_0', 'blocks')
  assert 'params/blocks/Dense_0/kernel' in probe.param_grads
  lines = localize.localize(probe, probe).lines()
  assert lines[:2] == ['forward pass: every module output bitwise equal',
                       'backward pass: every parameter gradient bitwise equal']
  assert lines[2].startswith('not recorded: module calls inside a transformed body (Linen nn.scan,'
                             ' nn.remat; NNX nnx.scan, nnx.remat, ...), whose values cannot leave it:'
                             ' blocks/Dense_0, blocks;')
  # An NNX side that calls its stack as one module (outside any transform) is not unmatched there.
  nnx_like = dataclasses.replace(probe, order=['inp', 'blocks', 'head', localize.ROOT], unrecorded=())
  assert localize.localize(probe, nnx_like).only_nnx == []


def test_a_divergence_inside_rematerialised_layers_names_the_unrecorded_calls():
  """The hidden layers under nn.remat and nnx.remat, layer 1 broken: calls inside either
  transform's body cannot be recorded (NNX's are the transform's copies, named by their
  originals). The first recorded call whose input differs is the head's; the localizer
  names the unrecorded layers as where the difference may have arisen, not only the root."""
  result = _localize((1, 'forward'), remat=True)
  assert result.unrecorded == ('dense_0', 'dense_1')  # both sides: the NNX copies are named
  assert (result.only_linen, result.only_nnx) == ([], [])
  assert (result.forward, result.forward_call, result.forward_unrecorded) == (
      localize.ROOT, 'dense_2', ('dense_0', 'dense_1'))
  line = result.lines()[0]
  assert line.startswith('forward pass: inside module (model): the input of dense_2 (NNX: layers/2) differs while'
                         ' every earlier recorded call agrees'), line
  assert line.endswith('it arose in a call not recorded there, dense_0, dense_1 (inside a transformed'
                       " body), or in (model)'s own code between its submodules"), line
  assert _localize(None, remat=True).clean


# ---------------------------------------------------------------------------
# One planted bug per stock-layer family, and the stock attention difference
# ---------------------------------------------------------------------------


def _family_localization(module_file, cfg, broken_create=None, pair_name=None):
  """Localize a family pair, its NNX side built by `broken_create` (None: the pair as declared)."""
  import functools

  from parity.battery import checks as battery
  from parity.pairs.adapter import Pair

  if pair_name is not None:
    pair = getattr(module_file, pair_name)
  else:
    def make_sides(mesh):
      linen, nnx_side = module_file.make_sides(cfg, mesh)
      return linen, dataclasses.replace(nnx_side, create=broken_create)

    pair = Pair('broken', make_sides, module_file.classifier.batch if hasattr(module_file, 'classifier')
                else module_file.encoder.batch)
  runs = battery._runs(pair)
  return runs.localization().first(0)


@pytest.mark.xdist_group('parity-classifier')  # the Linen side's programs are the pair's
def test_a_classifier_batch_norm_epsilon_is_named():
  from models.nnx import classifier as nnx_classifier
  from tests import test_family_classifier as family

  def create(seed):
    model, optimizer = nnx_classifier.create_train_state(family.CFG, seed)
    model.bn2.epsilon = 1e-3  # the planted bug: flax's default is 1e-5
    return model, optimizer

  first = _family_localization(family, family.CFG, create)
  assert (first['path'], first['layer'], first['pass']) == ('BatchNorm_1', None, 'forward')


@pytest.mark.exhaustive
def test_an_encoder_layer_norm_epsilon_is_named():
  from models.nnx import encoder as nnx_encoder
  from tests import test_family_encoder as family

  def create(seed):
    model, optimizer = nnx_encoder.create_train_state(family.CFG, seed)
    model.layers[1].norm2.epsilon = 1e-3  # the planted bug: flax's default is 1e-6
    return model, optimizer

  first = _family_localization(family, family.CFG, create)
  assert (first['path'], first['layer'], first['pass']) == ('layers/LayerNorm_1', 1, 'forward')


@pytest.mark.xdist_group('parity-encoder')  # the pair's localization, computed once in its worker
def test_the_stock_attention_difference_is_named_with_its_pass():
  from tests import test_family_encoder as family

  first = _family_localization(family, None, pair_name='encoder_stock_attention')
  assert (first['path'], first['layer'], first['pass']) == (
      'layers/MultiHeadDotProductAttention_0', 0, 'forward'
  )
  assert 0 < first['max_ulp'] <= family.STOCK_ATTENTION.max_ulp


# ---------------------------------------------------------------------------
# In the battery's failure report: the localizer runs the first divergent step.


@pytest.mark.exhaustive
def test_a_training_divergence_is_localized_at_its_first_divergent_step():
  """The NNX classifier with twice the learning rate: step 0's loss is equal, step 1's is not.

  The report localizes step 1, both sides from the Linen state before it.
  Both passes are bitwise there, so it says the update differs, rather than
  localizing step 0, where nothing differs yet.
  """
  from parity.battery import checks as battery
  from parity.pairs.adapter import Pair
  from tests import test_family_classifier as family

  def make_sides(mesh):
    linen, _ = family.make_sides(family.CFG, mesh)
    _, nnx_side = family.make_sides(dataclasses.replace(family.CFG, learning_rate=2e-2), mesh)
    return linen, nnx_side

  pair = Pair('broken_update', make_sides, family.classifier.batch, steps=3)
  with pytest.raises(AssertionError) as e:
    battery.check_train(pair, 'linen')
  message = str(e.value)
  assert 'loss/step_0' not in message and 'loss/step_1' in message
  assert 'localizer (step 1, train mode):' in message
  assert 'forward pass: every module output bitwise equal' in message
  assert 'the difference is in what the step does with the gradients' in message
  # Twice the learning rate: the parameters move otherwise; adam's moments do not depend on it.
  part = re.search(r'after step 1, from the same state, the states differ in (\d+) leaves: (.*)', message)
  assert part is not None, message
  assert part.group(2).split(', ')[0].startswith('params/') and 'opt_state' not in part.group(2), part.group(0)


def test_the_first_divergent_step_is_the_first_whose_train_metrics_differ_in_a_bit():
  from parity.battery.checks import first_divergent_step

  steps = lambda *losses, tokens=4: [{'loss': jnp.float32(x), 'tokens': jnp.int32(tokens)} for x in losses]
  ones = steps(1.0, 1.0, 1.0)
  assert first_divergent_step(ones, steps(1.0, 1.0000001, 2.0)) == 1
  assert first_divergent_step(ones, steps(1.0, 1.0, -1.0)) == 2
  # Equal metrics, unequal final state: the last step.
  assert first_divergent_step(ones, steps(1.0, 1.0, 1.0)) == 2
  # -0.0 and 0.0 compare equal as numbers, not as bits.
  assert first_divergent_step(steps(0.0), steps(-0.0)) == 0
  # A metric other than the loss, and a dtype, count as well.
  assert first_divergent_step(ones, ones[:1] + steps(1.0, 1.0, tokens=5)) == 1
  assert first_divergent_step(ones, [{'loss': jnp.bfloat16(1.0), 'tokens': jnp.int32(4)}] + ones[1:]) == 0
