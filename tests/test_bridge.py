"""The bridge: round trips are the identity, bad input names every offending path."""
import jax
import jax.numpy as jnp
import pytest

from parity.core import paths
from bridge import train_state as bridge_state
from parity.core.errors import TreeMismatchError
from bridge.layout import AxisMove, Layout
from parity.core.bitwise import assert_bitwise_equal
from tests import tiers

pytestmark = pytest.mark.xdist_group(tiers.TINY_PRESET_GROUP)  # the tiny preset's inits, compiled once


@pytest.fixture(scope='module')
def states(tiny_sides):
  linen, nnx_side = tiny_sides
  return linen.init(0), nnx_side.init(1)


def test_params_linen_nnx_linen_is_identity(tiny_sides, states):
  linen, nnx_side = tiny_sides
  linen_state, nnx_state = states
  nnx_params = nnx_side.params(nnx_state)
  there = bridge_state.linen_params_to_nnx(linen_state.params, nnx_params)
  back = bridge_state.nnx_params_to_linen(there, linen_state.params)
  assert_bitwise_equal(linen_state.params, back, 'Linen -> NNX -> Linen params')


def test_params_nnx_linen_nnx_is_identity(tiny_sides, states):
  linen, nnx_side = tiny_sides
  linen_state, nnx_state = states
  nnx_params = nnx_side.params(nnx_state)
  back = bridge_state.linen_params_to_nnx(
      bridge_state.nnx_params_to_linen(nnx_params, linen_state.params), nnx_params
  )
  assert_bitwise_equal(nnx_params, back, 'NNX -> Linen -> NNX params')


def test_train_state_round_trips_are_identity(tiny_sides, states):
  linen, nnx_side = tiny_sides
  linen_state, nnx_state = states
  flat = linen.to_checkpoint(linen_state)
  assert_bitwise_equal(flat, linen.to_checkpoint(linen.from_checkpoint(
      nnx_side.to_checkpoint(nnx_side.from_checkpoint(flat)))), 'Linen -> NNX -> Linen state')
  flat = nnx_side.to_checkpoint(nnx_state)
  assert_bitwise_equal(flat, nnx_side.to_checkpoint(nnx_side.from_checkpoint(
      linen.to_checkpoint(linen.from_checkpoint(flat)))), 'NNX -> Linen -> NNX state')


def test_checkpoint_layout_paths(tiny_sides, states):
  """The NNX side writes the Linen layout, as in the seed logs."""
  _, nnx_side = tiny_sides
  flat = nnx_side.to_checkpoint(states[1])
  assert 'params/params/decoder/layers/mlp/wi_0/kernel' in flat
  assert 'opt_state/1/0/mu/params/decoder/layers/mlp/wi_0/kernel' in flat
  assert 'opt_state/1/0/nu/params/token_embedder/embedding' in flat
  assert flat['step'].dtype == jnp.int32


def _with(flat, path, value):
  out = dict(flat)
  if value is None:
    del out[path]
  else:
    out[path] = value
  return out


KERNEL = 'params/params/decoder/layers/mlp/wi_0/kernel'
MU = 'opt_state/1/0/mu/params/decoder/logits_dense/kernel'


@pytest.mark.parametrize('target', ['linen', 'nnx'])
@pytest.mark.parametrize('case', ['missing', 'extra', 'shape', 'dtype', 'two problems'])
def test_bad_input_raises_and_names_each_path(tiny_sides, states, target, case):
  linen, nnx_side = tiny_sides
  flat = linen.to_checkpoint(states[0])
  kernel = flat[KERNEL]
  if case == 'missing':
    bad, expect = _with(flat, KERNEL, None), ['decoder/layers/mlp/wi_0/kernel: missing']
  elif case == 'extra':
    bad = _with(flat, 'params/params/decoder/extra/kernel', kernel)
    expect = ['decoder/extra/kernel: extra']
  elif case == 'shape':
    bad = _with(flat, KERNEL, kernel[:, :1])
    expect = [f'decoder/layers/mlp/wi_0/kernel: shape: expected {list(kernel.shape)}, got {list(kernel[:, :1].shape)}']
  elif case == 'dtype':
    bad = _with(flat, KERNEL, kernel.astype(jnp.bfloat16))
    expect = ['decoder/layers/mlp/wi_0/kernel: dtype: expected float32, got bfloat16']
  else:
    bad = _with(_with(flat, KERNEL, None), MU, flat[MU].T)
    expect = ['decoder/layers/mlp/wi_0/kernel: missing', 'logits_dense/kernel: shape']
  side = linen if target == 'linen' else nnx_side
  with pytest.raises(TreeMismatchError) as info:
    side.from_checkpoint(bad)
  message = str(info.value)
  for fragment in expect:
    assert fragment in message, message
  assert len(info.value.problems) == len(expect)


def test_bad_step_is_refused(tiny_sides, states):
  linen, nnx_side = tiny_sides
  flat = linen.to_checkpoint(states[0])
  for bad in (jnp.float32(3.0), jnp.arange(2), jnp.int64(-1) if jax.config.jax_enable_x64 else jnp.int32(-1)):
    with pytest.raises(TreeMismatchError, match='step'):
      nnx_side.from_checkpoint(_with(flat, 'step', bad))


def test_layout_rule_moves_axis_and_name_together():
  layout = Layout((AxisMove('decoder/layers/', 1, 0),))
  x = jnp.arange(24).reshape(2, 3, 4)
  moved = layout.array_to_nnx('decoder/layers/mlp/wi_0/kernel', x)
  assert moved.shape == (3, 2, 4)
  assert layout.names_to_nnx('decoder/layers/mlp/wi_0/kernel', ('embed', 'layers', 'mlp')) == (
      'layers', 'embed', 'mlp')
  assert_bitwise_equal(x, layout.array_to_linen('decoder/layers/x', moved))
  assert layout.array_to_nnx('token_embedder/embedding', x) is x


def test_a_boxed_linen_state_flattens_as_its_arrays_and_refills_boxed():
  """`nn.with_logical_partitioning` boxes (and the optimizer moments optax builds
  from them) are leaves: the paths are the unboxed state's, with no `/value`,
  and refilling a boxed template gives the boxes back, names kept."""
  import flax.linen as nn
  import optax
  from flax.core import meta
  from flax.training import train_state

  from parity.core import paths
  from parity.pairs import stock_layout as bridge_stock

  dense = nn.Dense(4, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ('embed', 'mlp')))
  params = dense.init(jax.random.key(0), jnp.ones((1, 3)))['params']
  boxed = jax.tree.map(jnp.asarray, train_state.TrainState.create(apply_fn=dense.apply, params=params, tx=optax.adam(1e-3)))
  flat = bridge_stock.linen_to_checkpoint(boxed)
  assert sorted(flat) == sorted(bridge_stock.linen_to_checkpoint(meta.unbox(boxed)))
  assert {'params/kernel', 'opt_state/0/mu/kernel', 'opt_state/0/nu/kernel'} <= set(flat)
  doubled = {p: x * 2 for p, x in paths.flatten(boxed).items()}
  back = paths.fill('boxed', boxed, doubled)
  assert isinstance(back.params['kernel'], nn.LogicallyPartitioned)
  assert back.params['kernel'].names == ('embed', 'mlp')
  assert_bitwise_equal(doubled, paths.flatten(back), 'refilled boxed state')


@pytest.mark.parametrize('order', [1, -1], ids=['short_first', 'long_first'])
def test_an_optimizer_leaf_mirrors_the_longest_parameter_path_it_ends_with(order):
  """`enc/head/kernel`'s moment ends with `head/kernel` too: the answer is the longer, in any order."""
  params = ['head/kernel', 'enc/head/kernel'][::order]
  assert bridge_state.param_suffix('opt_state/0/mu/enc/head/kernel', params) == 'enc/head/kernel'
  assert bridge_state.param_suffix('opt_state/0/mu/head/kernel', params) == 'head/kernel'
  assert bridge_state.param_suffix('opt_state/0/count', params) is None


def test_stock_moments_of_nested_same_named_modules_keep_their_paths():
  """A model with `head` (renamed `Dense_0`) and `enc/head`: each Adam moment keeps its parameter's path."""
  import optax
  from flax import nnx

  from parity.pairs import stock_layout as bridge_stock

  class Enc(nnx.Module):
    def __init__(self, rngs):
      self.head = nnx.Linear(2, 2, rngs=rngs)

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.head = nnx.Linear(2, 2, rngs=rngs)
      self.enc = Enc(rngs)

  def state():
    model = Model(nnx.Rngs(0))
    return nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))[1]

  flat = bridge_stock.nnx_to_checkpoint(
      nnx.eval_shape(state), bridge_stock.Renames((('Dense_0', 'head'),)), convert=False
  )
  params = {p[len('params/'):] for p in flat if p.startswith('params/')}
  assert {'Dense_0/kernel', 'enc/head/kernel'} <= params, sorted(flat)
  for moment in ('mu', 'nu'):
    prefix = f'opt_state/0/{moment}/'
    assert {p[len(prefix):] for p in flat if p.startswith(prefix)} == params, sorted(flat)


def test_an_optimizer_attribute_that_is_one_variable_is_the_field_itself():
  """`optimizer.loss_scale = nnx.Variable(...)` declared as the field `loss_scale`: the
  checkpoint path is `loss_scale`, as a TrainState scalar field flattens, and it comes back."""
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  from parity.pairs import stock_layout as bridge_stock

  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  optimizer.loss_scale = nnx.Variable(jnp.float32(2.0**15))
  state = nnx.split((model, optimizer))[1]
  fields = (('loss_scale', 'loss_scale'),)
  flat = bridge_stock.nnx_to_checkpoint(state, bridge_stock.Renames(), fields=fields)
  assert sorted(flat) == ['loss_scale', 'params/bias', 'params/kernel', 'step'], sorted(flat)
  flat['loss_scale'] = np.float32(3.0)
  back = bridge_stock.checkpoint_to_nnx(flat, state, bridge_stock.Renames(), fields=fields)
  assert float(back[1]['loss_scale'][...]) == 3.0


def test_a_variable_type_with_no_linen_collection_is_named_with_its_path():
  """An `nnx.Dropout` holding its RNG stream, and a variable type of the user's own: the
  error names every such variable, its type and what to do about each."""
  import optax
  from flax import nnx

  from parity.pairs import stock_layout as bridge_stock

  class Counter(nnx.Variable):
    pass

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.head = nnx.Linear(2, 2, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)
      self.seen = Counter(jnp.int32(0))

  def state():
    model = Model(nnx.Rngs(0))
    return nnx.split((model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)))[1]

  with pytest.raises(TreeMismatchError) as e:
    bridge_stock.nnx_to_checkpoint(nnx.eval_shape(state), bridge_stock.Renames(), convert=False)
  got = {p.path: p.got for p in e.value.problems if p.expected == 'one of Param, BatchStat'}
  assert got == {'0/drop/rngs/count': 'RngCount', '0/drop/rngs/key': 'RngKey', '0/seen': 'Counter'}, str(e.value)
  assert 'RngCount, RngKey: an RNG stream kept in the model' in e.value.what, e.value.what
  assert 'rngs=key' in e.value.what and 'Counter: pass `collections=`' in e.value.what, e.value.what
  assert 'nnx_only=(nnx.RngState,)' in e.value.what, e.value.what


def test_state_only_the_nnx_side_has_is_left_out_of_the_layout_and_filled_back():
  """`nnx_only`: an RNG stream kept in the model has no checkpoint path; the way back takes
  it from the state given for it, and asks for it when none is."""
  import optax
  from flax import nnx

  from parity.pairs import stock_layout as bridge_stock

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.head = nnx.Linear(2, 2, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

  def create(seed):
    model = Model(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  only = (nnx.RngState,)
  _, state = nnx.split(create(0))
  flat = bridge_stock.nnx_to_checkpoint(state, bridge_stock.Renames(), nnx_only=only)
  assert sorted(flat) == ['params/head/bias', 'params/head/kernel', 'step'], sorted(flat)
  kept = nnx.split(create(1), nnx.RngState, ...)[1]
  back = bridge_stock.checkpoint_to_nnx(flat, state, bridge_stock.Renames(), nnx_only=only, nnx_only_state=kept)
  assert_bitwise_equal(paths.flatten(back), {**paths.flatten(state), **paths.flatten(kept)}, 'back')
  with pytest.raises(ValueError, match=r"\['0/drop/rngs/count', '0/drop/rngs/key'\] are not in the checkpoint"):
    bridge_stock.checkpoint_to_nnx(flat, state, bridge_stock.Renames(), nnx_only=only)
