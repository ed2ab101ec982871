"""Small pairs with one planted difference each, for the specs command, the localize part and
the checks proven to fail (tests/test_checks_fail.py, the planted MLP at the end).

A two-layer MLP: Linen `Block_0` (a Dense, an activation constraint, relu computed
inline) and a head; NNX `block` (`linear`, the same constraint, relu as a module of
its own, `act`, which Linen has no module for) and `head`. Parameters annotated with
logical names. Kept out of test files: a Pair at module level of a test file gets
the whole battery generated (import this module, not its names).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import parity

FEATURES, HIDDEN = 6, 16
RULES = (('batch', 'data'), ('embed', None), ('hidden', 'tensor'), ('mlp', 'tensor'))
MESH = 'data=2,tensor=4'
HIDDEN_AXES = ('batch', 'hidden')


def _init(axes):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(HIDDEN, kernel_init=_init(('embed', 'hidden')))(x)
    return nn.relu(nn.with_logical_constraint(h, HIDDEN_AXES))


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1, kernel_init=_init(('hidden', None)))(Block()(x))


class Act(nnx.Module):
  """relu as a module (Linen computes it inline); `slope` > 0: a leaky relu, the planted bug."""

  def __init__(self, slope: float):
    self.slope = slope

  def __call__(self, x):
    return nnx.leaky_relu(x, self.slope) if self.slope else nnx.relu(x)


class NnxBlock(nnx.Module):
  def __init__(self, rngs, kernel_axes, constraint, slope):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel_axes)
    self.linear = nnx.Linear(FEATURES, HIDDEN, kernel_init=init, rngs=rngs)
    self.act = Act(slope)
    self.constraint = constraint

  def __call__(self, x):
    return self.act(nn.with_logical_constraint(self.linear(x), self.constraint))


class NnxModel(nnx.Module):
  def __init__(self, rngs, kernel_axes=('embed', 'hidden'), constraint=HIDDEN_AXES, slope=0.0):
    self.block = NnxBlock(rngs, kernel_axes, constraint, slope)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ('hidden', None))
    self.head = nnx.Linear(HIDDEN, 1, kernel_init=init, rngs=rngs)

  def __call__(self, x):
    return self.head(self.block(x))


def _linen_create(seed):
  model = LinenModel()
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, FEATURES)))['params']
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))


def _linen_loss(params, state, batch, key):
  return jnp.mean((state.apply_fn({'params': params}, batch['x']) - batch['y']) ** 2)


@jax.jit
def _linen_train(state, batch, dropout_base):
  loss, grads = jax.value_and_grad(_linen_loss)(state.params, state, batch, None)
  return state.apply_gradients(grads=grads), {'loss': loss}


@jax.jit
def _linen_eval(state, batch):
  return {'loss': _linen_loss(state.params, state, batch, None)}


def _nnx_create(options, seed):
  model = NnxModel(nnx.Rngs(params=seed), **dict(options))
  return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _nnx_loss(model, batch, key):
  return jnp.mean((model(batch['x']) - batch['y']) ** 2)


@nnx.jit
def _nnx_train(model, optimizer, batch, dropout_base):
  loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch, None)
  optimizer.update(model, grads)
  return {'loss': loss}


@nnx.jit
def _nnx_eval(model, batch):
  return {'loss': _nnx_loss(model, batch, None)}


def batch(step, split='train'):
  """8 rows of FEATURES inputs and one target each, by step and split."""
  rng = np.random.default_rng([{'train': 0, 'eval': 1}[split], step])
  return {'x': rng.standard_normal((8, FEATURES), dtype=np.float32),
          'y': rng.standard_normal((8, 1), dtype=np.float32)}


def _make_sides(options, mesh):
  return (parity.StockLinen(_linen_create, _linen_train, _linen_eval, _linen_loss, mesh=mesh, rules=RULES),
          parity.StockNnx(functools.partial(_nnx_create, options), _nnx_train, _nnx_eval, _nnx_loss,
                          mesh=mesh, rules=RULES))


def pair(name: str, **nnx_options) -> parity.Pair:
  """The MLP pair, the NNX model made with `nnx_options` (NnxModel's keywords: the planted bug)."""
  return parity.Pair(name, functools.partial(_make_sides, tuple(sorted(nnx_options.items()))), batch,
                     meshes=(MESH,), rules=RULES, steps=1)


same = pair('same')
renamed_annotation = pair('renamed_annotation', kernel_axes=('embed', 'mlp'))
renamed_constraint = pair('renamed_constraint', constraint=('batch', 'mlp'))
leaky_act = pair('leaky_act', slope=0.5)


# --- Planted pairs: one bug each in the NNX side, for tests/test_checks_fail.py (and ----
# tests/test_truthful_messages.py) -------------------------------------------------------
# A bag-of-tokens MLP of flax's stock layers, VOCAB counts in and VOCAB logits out (so it
# decodes: the cache is the counts of the tokens fed), dropout after its first layer:
# Linen Dense_0 (no bias), Dropout_0, Dense_1 (RMSNorm_0), Dense_2 (LayerNorm_0 or RMSNorm_0),
# Dense_3; NNX `inp`, `dropout`, `hidden1` (`rms`), `hidden2` (`norm`), `out`.
# `planted(name, **bugs)` makes a pair whose NNX side carries the bugs named (PlantedNnx's
# keywords, and SIDE_OPTIONS: `fixed_key`, `decode`, `eval_rmse`, StockNnx's own; `norm` and
# `zero` shape both sides); sides are made once per set of options and shared between pairs,
# so a program compiles once per process.

VOCAB, WIDTH, RATE = 8, 8, 0.5
PROMPT, DECODE_STEPS = 3, 4
SWAPPED_RENAMES = parity.Renames((('Dense_1', 'hidden1'), ('Dense_2', 'hidden2')))


class RMSNorm(nn.Module):
  """The project's own RMS norm, named as flax's stock one (tests/test_truthful_messages.py)."""

  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.epsilon) * scale


class NnxRMSNorm(nnx.Module):
  """RMSNorm in NNX, the same code."""

  def __init__(self, features: int, epsilon: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((features,)))
    self.epsilon = epsilon

  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.epsilon) * self.scale[...]


class PlantedLinen(nn.Module):
  """Dense_0 (no bias), relu, Dropout_0, Dense_1, relu, [RMSNorm_0], Dense_2, [LayerNorm_0 or RMSNorm_0],
  relu, Dense_3."""

  stream: bool = False  # dropout draws make_rng('dropout'); else the key passed at the call
  # True: a LayerNorm after Dense_2 (flax's stock norm lowers otherwise in NNX); 'rms+layer': and
  # flax's stock RMSNorm after Dense_1 (as otherwise); 'own': the project's own RMSNorm after Dense_2.
  norm: bool | str = False
  zero: bool = False  # Dense_1 and Dense_2 initialised to zeros: no gradient reaches them or what feeds them

  @nn.compact
  def __call__(self, x, train: bool, key=None):
    h = nn.relu(nn.Dense(WIDTH, use_bias=False)(x))
    h = nn.Dropout(RATE, deterministic=not train)(h, rng=None if self.stream else key)
    init = nn.initializers.zeros if self.zero else nn.initializers.lecun_normal()
    h = nn.relu(nn.Dense(WIDTH, kernel_init=init)(h))  # Dense_1 made and called first, then Dense_2
    if self.norm == 'rms+layer':
      h = nn.RMSNorm()(h)
    h = nn.Dense(WIDTH, kernel_init=init)(h)
    if self.norm == 'own':
      h = RMSNorm()(h)
    elif self.norm:
      h = nn.LayerNorm()(h)
    return nn.Dense(VOCAB)(nn.relu(h))


class Calls(nnx.Variable):
  """A count of train-mode calls: state only the NNX side keeps (no Linen collection holds it)."""


class PlantedNnx(nnx.Module):
  """PlantedLinen in NNX; each keyword plants a bug (all False: the same program)."""

  def __init__(self, rngs, stream=False, norm=False, frozen=False, swapped=False, eval_scaled=False,
               counted=False, epsilon=None, zero=False, mode_flipped=False, eval_dropping=False):
    self.inp = nnx.Linear(VOCAB, WIDTH, use_bias=False, rngs=rngs)
    # stream: a stock dropout holding its RNG stream, called without a key ('params': the bug, a
    # stream forked from the model's params stream, not its dropout stream).
    self.dropout = (nnx.Dropout(RATE, rng_collection='params', rngs=rngs) if stream == 'params' else
                    nnx.Dropout(RATE, rngs=rngs) if stream else nnx.Dropout(RATE))
    init = nnx.initializers.zeros if zero else nnx.initializers.lecun_normal()  # zero: as PlantedLinen's
    self.hidden1 = nnx.Linear(WIDTH, WIDTH, kernel_init=init, rngs=rngs)
    self.rms = nnx.RMSNorm(WIDTH, rngs=rngs) if norm == 'rms+layer' else None
    self.hidden2 = nnx.Linear(WIDTH, WIDTH, kernel_init=init, rngs=rngs)
    # epsilon: the bug, another epsilon in the norm after hidden2 (flax's LayerNorm, or the project's RMSNorm)
    eps = {} if epsilon is None else {'epsilon': epsilon}
    self.norm = (NnxRMSNorm(WIDTH, **eps) if norm == 'own' else nnx.LayerNorm(WIDTH, rngs=rngs, **eps) if norm
                 else None)
    self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)
    self.calls = Calls(jnp.zeros((), jnp.int32)) if counted else None
    self.stream, self.frozen, self.swapped, self.eval_scaled = stream, frozen, swapped, eval_scaled
    self.mode_flipped = mode_flipped  # the bug: the dropout given the mode the other way round
    self.eval_dropping = eval_dropping  # the bug: the dropout on in eval mode too (a model.eval() forgotten)

  def __call__(self, x, train: bool, key=None):
    h = self.inp(x)
    if self.frozen:  # the bug: the same values, no gradient reaches `inp`
      h = jax.lax.stop_gradient(h)
    deterministic = False if self.eval_dropping else train if self.mode_flipped else not train
    h = self.dropout(nnx.relu(h), deterministic=deterministic, rngs=None if self.stream else key)
    if self.eval_scaled and not train:  # the bug: inference-time dropout scaling, in eval mode only
      h = h * (1 - RATE)
    first, second = (self.hidden2, self.hidden1) if self.swapped else (self.hidden1, self.hidden2)
    h = nnx.relu(first(h))
    if self.rms is not None:
      h = self.rms(h)
    h = second(h)
    if self.norm is not None:
      h = self.norm(h)
    if self.calls is not None and train:
      self.calls[...] += 1
    return self.out(nnx.relu(h))


def planted_batch(step, split='train'):
  """8 rows of VOCAB inputs and VOCAB targets, by step and split."""
  rng = np.random.default_rng([{'train': 0, 'eval': 1}[split], step, 7])
  return {'x': rng.standard_normal((8, VOCAB), dtype=np.float32),
          'y': rng.standard_normal((8, VOCAB), dtype=np.float32)}


def planted_prompt(batch):
  """PROMPT tokens a row, from the batch's inputs."""
  return np.argsort(np.asarray(batch['x']), axis=1)[:, :PROMPT].astype(np.int32)


def _bag_call(apply, first_index=0):
  """A decode call: the cache counts the tokens fed; `apply(counts)` gives the next logits."""

  def call(tokens_BL, cache):
    fed_BV = jax.nn.one_hot(tokens_BL, VOCAB, dtype=jnp.float32).sum(axis=1)
    if cache is None:
      cache = {'counts': jnp.zeros_like(fed_BV), 'index': jnp.asarray(first_index, jnp.int32)}
    counts_BV = cache['counts'] + fed_BV
    return apply(counts_BV)[:, None], {'counts': counts_BV, 'index': cache['index'] + tokens_BL.shape[1]}

  return call


@functools.cache
def _planted_linen_code(stream, norm, zero=False):
  """(create, train, eval, loss, forward, decode) of the Linen side."""
  model = PlantedLinen(stream=stream, norm=norm, zero=zero)

  def create(seed):
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, VOCAB)), train=False)['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

  def loss(params, state, batch, key):
    keys = {'rngs': {'dropout': key}} if stream else {'key': key}
    return jnp.mean((state.apply_fn({'params': params}, batch['x'], train=True, **keys) - batch['y']) ** 2)

  @jax.jit
  def train(state, batch, dropout_base):
    value, grads = jax.value_and_grad(loss)(state.params, state, batch, parity.step_key(dropout_base, state.step, 0))
    return state.apply_gradients(grads=grads), {'loss': value}

  def forward(state, batch):
    return state.apply_fn({'params': state.params}, batch['x'], train=False)

  @jax.jit
  def evaluate(state, batch):
    return {'loss': jnp.mean((forward(state, batch) - batch['y']) ** 2)}

  def decode(state, prompt, steps, key, temperature):
    apply = lambda counts: state.apply_fn({'params': state.params}, counts, train=False)  # noqa: E731
    return parity.decode_loop(_bag_call(apply), prompt, steps, key, temperature)

  return create, train, evaluate, loss, forward, decode


@functools.cache
def _planted_nnx_code(model_options, fixed_key, decode_bug, eval_rmse):
  """(create, train, eval, loss, forward, decode) of the NNX side, with its bugs."""
  options = dict(model_options)
  default_rngs = options.pop('default_rngs', False)  # nnx.Rngs(seed) alone: every stream falls back to 'default'

  def create(seed):
    model = PlantedNnx(nnx.Rngs(seed) if default_rngs else nnx.Rngs(params=seed, dropout=seed + 1), **options)
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  def loss(model, batch, key):
    return jnp.mean((model(batch['x'], train=True, key=key) - batch['y']) ** 2)

  @nnx.jit
  def train(model, optimizer, batch, dropout_base):
    step = 0 if fixed_key else optimizer.step[...]  # fixed_key, the bug: every step draws step 0's masks
    value, grads = nnx.value_and_grad(loss)(model, batch, parity.step_key(dropout_base, step, 0))
    optimizer.update(model, grads)
    return {'loss': value}

  def forward(model, batch):
    return model(batch['x'], train=False)

  @nnx.jit
  def evaluate(model, batch):
    mse = jnp.mean((forward(model, batch) - batch['y']) ** 2)
    return {'loss': jnp.sqrt(mse) if eval_rmse else mse}  # eval_rmse, the bug: the metric is another

  def decode(model, prompt, steps, key, temperature):
    if decode_bug == 'logits':  # logits doubled: the same argmax, so the same greedy tokens and cache
      apply = lambda counts: model(counts, train=False) * 2.0  # noqa: E731
    else:
      apply = lambda counts: model(counts, train=False)  # noqa: E731
    call = _bag_call(apply, first_index=1 if decode_bug == 'cache' else 0)  # cache: an index the logits never read
    tokens, logits, cache = parity.decode_loop(call, prompt, steps, key, temperature)
    if decode_bug == 'tokens':  # tokens returned otherwise than drawn and fed
      tokens = (tokens + 1) % VOCAB
    if decode_bug == 'ulp':  # logits one ULP up: the same argmax
      logits = jnp.nextafter(logits, jnp.inf)
    return tokens, logits, cache

  return create, train, evaluate, loss, forward, decode


@functools.cache
def _planted_linen_side(stream, norm, mesh, zero=False):
  create, train, evaluate, loss, forward, decode = _planted_linen_code(stream, norm, zero)
  return parity.StockLinen(create, train, evaluate, loss, mesh=mesh, forward=forward, decode_fn=decode)


@functools.cache
def _planted_nnx_side(model_options, side_options, mesh):
  side_options = dict(side_options)
  code = _planted_nnx_code(model_options, side_options.pop('fixed_key', False), side_options.pop('decode', None),
                           side_options.pop('eval_rmse', False))
  create, train, evaluate, loss, forward, decode = code
  return parity.StockNnx(create, train, evaluate, loss, mesh=mesh, forward=forward, decode_fn=decode,
                         **side_options)


SIDE_OPTIONS = ('fixed_key', 'decode', 'eval_rmse', 'nnx_only', 'dropout_keys', 'renames', 'infer_renames')


def _planted_sides(model_options, side_options, mesh):
  options = dict(model_options)
  linen = _planted_linen_side(bool(options.get('stream', False)), options.get('norm', False), mesh,
                              options.get('zero', False))
  return linen, _planted_nnx_side(model_options, side_options, mesh)


def planted(name: str, **bugs) -> parity.Pair:
  """The planted MLP's pair, its NNX side with `bugs` (PlantedNnx's keywords, SIDE_OPTIONS);
  `Pair` keywords as `pair_options`."""
  pair_options = bugs.pop('pair_options', {})
  side = tuple(sorted((k, bugs.pop(k)) for k in SIDE_OPTIONS if k in bugs))
  make_sides = functools.partial(_planted_sides, tuple(sorted(bugs.items())), side)
  return parity.Pair(name, make_sides, planted_batch, steps=2, meshes=('data=8',),
                     decode=parity.Decode(planted_prompt, steps=DECODE_STEPS, temperatures=(0.0,)),
                     **pair_options)


def planted_sides(**bugs):
  """The `make_sides(mesh)` of `planted(..., **bugs)`: a declared difference's substitute."""
  return planted('substitute', **bugs).make_sides


_PLANTED: dict[str, 'parity.Pair'] = {}


def planted_once(name: str, **bugs) -> 'parity.Pair':
  """`planted(name, **bugs)`, one object per process and options (its runs are shared)."""
  key = f'{name}{sorted(bugs.items())!r}'
  if key not in _PLANTED:
    _PLANTED[key] = planted(name, **bugs)
  return _PLANTED[key]


def failure_of(check, *args) -> str:
  """The message of the AssertionError `check(*args)` must raise."""
  import pytest

  with pytest.raises(AssertionError) as failure:
    check(*args)
  return str(failure.value)
