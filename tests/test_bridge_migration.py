"""A module-by-module migration through `nnx.bridge`, each step proven, as a user would.

One small residual language model in three steps: all Linen; half
migrated, its MLPs the other framework's through flax's wrappers; all NNX.
A half-migrated side is proven against the fully migrated other side, each
framework's way round:

- `linen_to_half`: the all-Linen model against an NNX model whose MLPs are
  still the Linen ones, through `nnx.bridge.ToNNX` (migrating top-down);
- `half_to_nnx`: a Linen model whose MLPs are already the NNX ones, through
  `nnx.bridge.ToLinen` (migrating bottom-up), against the all-NNX model;
- `linen_to_nnx`: the two ends (the exhaustive tier's: a plain pair, as the other families').

Every part of the battery runs on each, memory and program included: the
RNG stream a `ToNNX` keeps is NNX-only state, declared by default and
accounted as any other. The core tier runs the parts that cross the
wrappers (structure, init, grads, memory, program, localize);
the exhaustive tier the rest, the two ends and the planted bugs.

The kit sees through the wrappers with no code from the user: the
checkpoint layout (each wrapper keeps the wrapped module's variables under
its own path, `params/mlp_0/up/kernel` in both), the inferred
correspondences and the localizer (the calls inside a wrapper are recorded
under its path), so a bug planted inside a bridged module is named there.
"""
# --- glue ---
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import parity


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 32
  dim: int = 16
  hidden: int = 32
  layers: int = 2
  batch: int = 8
  length: int = 8
  learning_rate: float = 1e-2


CFG = Config()


def batch(cfg: Config, step: int, split: str):
  rng = np.random.default_rng(step + (1000 if split == 'eval' else 0))
  tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.length + 1), dtype=np.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}


# -- the Linen model and its step functions ------------------------------------------------


class LinenMlp(nn.Module):
  dim: int
  hidden: int
  bug: bool = False  # a planted bug: tanh in place of gelu

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.hidden, name='up')(x)
    return nn.Dense(self.dim, name='down')(jnp.tanh(h) if self.bug else nn.gelu(h))


class NnxMlp(nnx.Module):
  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, bug: bool = False):
    self.up = nnx.Linear(dim, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, rngs=rngs)
    self.bug = bug

  def __call__(self, x):
    h = self.up(x)
    return self.down(jnp.tanh(h) if self.bug else nnx.gelu(h))


class LinenLm(nn.Module):
  """All Linen; with `bridged`, its MLPs are `NnxMlp` through `nnx.bridge.ToLinen`."""

  cfg: Config
  bridged: bool = False
  bug_in_layer: int | None = None

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.dim, name='embed')(tokens)
    for i in range(cfg.layers):
      bug = i == self.bug_in_layer
      if self.bridged:
        mlp = nnx.bridge.ToLinen(NnxMlp, args=(cfg.dim, cfg.hidden), kwargs={'bug': bug}, name=f'mlp_{i}')
      else:
        mlp = LinenMlp(cfg.dim, cfg.hidden, bug, name=f'mlp_{i}')
      x = x + mlp(x)
    return nn.Dense(cfg.vocab, name='head')(x)


def linen_create(cfg: Config, seed: int, bridged: bool = False, bug_in_layer: int | None = None):
  model = LinenLm(cfg, bridged, bug_in_layer)
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, cfg.length), jnp.int32))['params']
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(cfg.learning_rate))


def _cross_entropy(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def linen_loss(params, state, batch, dropout_key):
  del dropout_key  # no dropout
  return _cross_entropy(state.apply_fn({'params': params}, batch['inputs']), batch['targets'])


@jax.jit
def linen_train_step(state, batch, dropout_base):
  loss, grads = jax.value_and_grad(linen_loss)(state.params, state, batch, None)
  return state.apply_gradients(grads=grads), {'loss': loss}


@jax.jit
def linen_eval_step(state, batch):
  return {'loss': linen_loss(state.params, state, batch, None)}


def linen_forward(state, batch):
  return state.apply_fn({'params': state.params}, batch['inputs'])


# -- the NNX model and its step functions --------------------------------------------------


class NnxLm(nnx.Module):
  """All NNX; with `bridged`, its MLPs are `LinenMlp` through `nnx.bridge.ToNNX`."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, bridged: bool = False, bug_in_layer: int | None = None):
    self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
    for i in range(cfg.layers):
      bug = i == bug_in_layer
      if bridged:
        mlp = nnx.bridge.ToNNX(LinenMlp(cfg.dim, cfg.hidden, bug), rngs=rngs)
        nnx.bridge.lazy_init(mlp, jnp.zeros((1, cfg.length, cfg.dim)))
      else:
        mlp = NnxMlp(cfg.dim, cfg.hidden, rngs=rngs, bug=bug)
      setattr(self, f'mlp_{i}', mlp)
    self.head = nnx.Linear(cfg.dim, cfg.vocab, rngs=rngs)
    self.layers = cfg.layers

  def __call__(self, tokens):
    x = self.embed(tokens)
    for i in range(self.layers):
      x = x + getattr(self, f'mlp_{i}')(x)
    return self.head(x)


def nnx_create(cfg: Config, seed: int, bridged: bool = False, bug_in_layer: int | None = None):
  model = NnxLm(cfg, rngs=nnx.Rngs(seed), bridged=bridged, bug_in_layer=bug_in_layer)
  return model, nnx.Optimizer(model, optax.adam(cfg.learning_rate), wrt=nnx.Param)


def nnx_loss(model, batch, dropout_key):
  del dropout_key  # no dropout
  return _cross_entropy(model(batch['inputs']), batch['targets'])


@nnx.jit
def nnx_train_step(model, optimizer, batch, dropout_base):
  loss, grads = nnx.value_and_grad(nnx_loss)(model, batch, None)
  optimizer.update(model, grads)
  return {'loss': loss}


@nnx.jit
def nnx_eval_step(model, batch):
  return {'loss': nnx_loss(model, batch, None)}


def nnx_forward(model, batch):
  return model(batch['inputs'])


# -- the three steps, as pairs -------------------------------------------------------------


def sides(linen_bridged: bool, nnx_bridged: bool, bug: tuple[str, int] | None = None):
  """make_sides of one step: (Linen side, NNX side), either bridged; `bug`: (side, layer)."""

  def make_sides(mesh):
    linen_bug = bug[1] if bug and bug[0] == 'linen' else None
    nnx_bug = bug[1] if bug and bug[0] == 'nnx' else None
    linen = parity.StockLinen(functools.partial(linen_create, CFG, bridged=linen_bridged, bug_in_layer=linen_bug),
                              linen_train_step, linen_eval_step, linen_loss, mesh=mesh, forward=linen_forward)
    nnx_side = parity.StockNnx(functools.partial(nnx_create, CFG, bridged=nnx_bridged, bug_in_layer=nnx_bug),
                               nnx_train_step, nnx_eval_step, nnx_loss, mesh=mesh, forward=nnx_forward)
    return linen, nnx_side

  return make_sides


linen_to_half = parity.Pair('linen_to_half', sides(False, True), functools.partial(batch, CFG))
half_to_nnx = parity.Pair('half_to_nnx', sides(True, False), functools.partial(batch, CFG))
linen_to_nnx = parity.Pair('linen_to_nnx', sides(False, False), functools.partial(batch, CFG))
# --- end of glue ---

import pytest  # noqa: E402


@pytest.mark.exhaustive  # a planted bug: the exhaustive tier's, as the other families'
@pytest.mark.parametrize('pair,bridged_side', [(linen_to_half, 'nnx'), (half_to_nnx, 'linen')])
def test_a_bug_inside_a_bridged_module_is_localised_to_it(pair, bridged_side):
  """tanh for gelu in layer 1's MLP, on the bridged side (inside its wrapper): the grads part
  fails and the localizer names that MLP's call, seen through the wrapper."""
  from parity.battery import checks

  broken = dataclasses.replace(pair, name=f'{pair.name}_bug', make_sides=sides(
      pair is half_to_nnx, pair is linen_to_half, bug=(bridged_side, 1)), parts=('grads',))
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(broken)
  message = str(failure.value)
  assert ('forward pass: inside module mlp_1, outside its submodules: the input of mlp_1/down differs'
          ' while every earlier call agrees') in message, message


class _AutoNamed(nn.Module):
  """`LinenLm` bridged, its wrappers named by Linen (`ToLinen_0`, ...), not `mlp_<i>`."""

  cfg: Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.dim, name='embed')(tokens)
    for _ in range(cfg.layers):
      x = x + nnx.bridge.ToLinen(NnxMlp, args=(cfg.dim, cfg.hidden))(x)
    return nn.Dense(cfg.vocab, name='head')(x)


def test_correspondences_are_inferred_through_the_wrappers():
  """No renames given: each Linen-named wrapper pairs with the NNX module it wraps, and the
  modules inside keep their own names (traced only: nothing compiled)."""

  def create(seed):
    model = _AutoNamed(CFG)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, CFG.length), jnp.int32))['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(CFG.learning_rate))

  linen = parity.StockLinen(create, linen_train_step, linen_eval_step, linen_loss)
  nnx_side = sides(False, False)(None)[1]
  found = nnx_side.correspondence(linen, batch(CFG, 0, 'train'), parity.step_key(parity.base_key(0), 0, 0))
  assert [found.renames.to_nnx(p) for p in ('ToLinen_0', 'ToLinen_1/up', 'ToLinen_1/down', 'head')] == [
      'mlp_0', 'mlp_1/up', 'mlp_1/down', 'head'], found.renames
  assert found.call_keys == ()
