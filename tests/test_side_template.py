"""The side template (docs/howto-own-steps.md): a repository with
models and no train step writes both sides' steps itself, as `parity.model_pair` writes them, for
`parity.StockLinen` and `parity.StockNnx`. The page copies the block between the markers verbatim
(tests/test_docs.py checks it), and the plugin generates the battery for it here.

The models, batch and loss are the tutorial's (tests/test_first_pair.py); the pair's own code is
the steps. Its battery passes as the model-level pair's does: the hand-written steps are the same
program, dropout on (`StockNnx(dropout_keys='linen')`).
"""
# --- side template ---
import jax
import optax
from flax import nnx
from flax.training import train_state

import parity
from tests.test_first_pair import LinenMLP, NnxMLP, batch, loss  # yours: two models, batch(step, split), loss

OPTIMIZER = optax.adam(1e-3)


# -- the Linen side: a flax TrainState and functional steps ---------------------------------------
def linen_create(seed: int) -> train_state.TrainState:
  model = LinenMLP()
  variables = model.init(jax.random.PRNGKey(seed), batch(0, 'train')['x'], train=False)
  # params as init gives them: boxed where the model annotates them (nn.with_logical_partitioning)
  return train_state.TrainState.create(apply_fn=model.apply, params=variables['params'], tx=OPTIMIZER)


def linen_loss(params, state, batch, dropout_key):
  logits = state.apply_fn({'params': params}, batch['x'], train=True, rngs={'dropout': dropout_key})
  return loss(logits, batch)


@jax.jit
def linen_train_step(state, batch, dropout_base):
  key = parity.step_key(dropout_base, state.step, 0)  # this step's dropout key
  value, grads = jax.value_and_grad(linen_loss)(state.params, state, batch, key)
  return state.apply_gradients(grads=grads), {'loss': value}


def linen_forward(state, batch):
  return state.apply_fn({'params': state.params}, batch['x'], train=False)


@jax.jit
def linen_eval_step(state, batch):
  return {'loss': loss(linen_forward(state, batch), batch)}


# -- the NNX side: (model, nnx.Optimizer) and steps that update them in place ----------------------
def nnx_create(seed: int) -> tuple[nnx.Module, nnx.Optimizer]:
  model = NnxMLP(rngs=nnx.Rngs(seed))
  return model, nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param)


def nnx_loss(model, batch, dropout_key):
  logits = model(batch['x'], train=True, rngs=nnx.Rngs(dropout=dropout_key))
  return loss(logits, batch)


@nnx.jit
def nnx_train_step(model, optimizer, batch, dropout_base):
  key = parity.step_key(dropout_base, optimizer.step[...], 0)  # the same key as Linen's
  value, grads = nnx.value_and_grad(nnx_loss)(model, batch, key)
  optimizer.update(model, grads)
  return {'loss': value}


def nnx_forward(model, batch):
  return model(batch['x'], train=False)


@nnx.jit
def nnx_eval_step(model, batch):
  return {'loss': loss(nnx_forward(model, batch), batch)}


# -- the pair --------------------------------------------------------------------------------------
def make_sides(mesh):
  linen = parity.StockLinen(linen_create, linen_train_step, linen_eval_step, linen_loss, mesh=mesh,
                            forward=linen_forward)
  nnx_side = parity.StockNnx(nnx_create, nnx_train_step, nnx_eval_step, nnx_loss, mesh=mesh,
                             forward=nnx_forward, dropout_keys='linen')  # nnx.Dropout draws Linen's keys
  return linen, nnx_side


mlp_own_steps = parity.Pair('mlp_own_steps', make_sides, batch)
# --- end of side template ---

import flax.linen as nn  # noqa: E402
import pytest  # noqa: E402
from flax.core import meta  # noqa: E402


class _Annotated(nn.Module):
  """A Linen model whose kernel carries logical axes: `init` gives it boxed."""

  @nn.compact
  def __call__(self, x):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ('embed', 'mlp'))
    return nn.Dense(4, kernel_init=init)(x)


@pytest.mark.parametrize('jitted', [True, False], ids=['jitted', 'plain'])
def test_create_may_return_boxed_params_and_the_steps_get_them_plain_jitted_or_not(jitted):
  """`create` keeps `init`'s boxes (the side reads the specs from them); the steps, jitted or not,
  receive plain arrays, because the side unboxes the state and compiles each step itself."""
  model = _Annotated()
  x = batch(0, 'train')['x']

  def create(seed):
    params = model.init(jax.random.PRNGKey(seed), x)['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

  def loss_fn(params, state, batch, key):
    return state.apply_fn({'params': params}, batch['x']).mean()

  seen = []

  def train_step(state, batch, dropout_base):
    seen.append(type(state.params['Dense_0']['kernel']))
    value, grads = jax.value_and_grad(loss_fn)(state.params, state, batch, None)
    return state.apply_gradients(grads=grads), {'loss': value}

  def eval_step(state, batch):
    return {'loss': loss_fn(state.params, state, batch, None)}

  step = jax.jit(train_step) if jitted else train_step
  side = parity.StockLinen(create, step, eval_step, loss_fn)
  assert isinstance(create(0).params['Dense_0']['kernel'], nn.LogicallyPartitioned)
  assert side.param_specs() == {'params/Dense_0/kernel': ('embed', 'mlp'), 'params/Dense_0/bias': ()}
  state = side.init(0)
  assert not any(isinstance(x, meta.AxisMetadata) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)))
  state, metrics = side.train_step(state, side.place_batch(batch(0, 'train')), parity.base_key(0))
  assert seen and all(not issubclass(t, meta.AxisMetadata) for t in seen), seen
  assert int(state.step) == 1 and metrics['loss'].shape == ()


def _unjitted(step):
  """The function a `jax.jit` or `nnx.jit` decorator wraps."""
  return step.__wrapped__


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-mlp_own_steps')
def test_steps_jitted_on_both_sides_or_neither_are_one_program_on_one_side_only_another():
  """The sides compile each step themselves: unjitted steps give the template's program, and a step
  jitted on one side only is a nested call there, which the program part names (the numbers equal)."""
  from parity.battery import checks

  def pair(name, linen_jitted, nnx_jitted):
    def make(mesh):
      linen = parity.StockLinen(
          linen_create, linen_train_step if linen_jitted else _unjitted(linen_train_step),
          linen_eval_step if linen_jitted else _unjitted(linen_eval_step), linen_loss, mesh=mesh)
      nnx_side = parity.StockNnx(
          nnx_create, nnx_train_step if nnx_jitted else _unjitted(nnx_train_step),
          nnx_eval_step if nnx_jitted else _unjitted(nnx_eval_step), nnx_loss, mesh=mesh, dropout_keys='linen')
      return linen, nnx_side

    return parity.Pair(name, make, batch)

  neither = pair('mlp_own_steps_unjitted', False, False)
  assert checks.check_train(neither, 'linen') == [] and checks.check_program(neither) == []
  linen_only = pair('mlp_own_steps_linen_jitted', True, False)
  assert checks.check_train(linen_only, 'linen') == []
  with pytest.raises(AssertionError, match=r'programs differ') as failure:
    checks.check_program(linen_only)
  assert 'call @' in str(failure.value)
