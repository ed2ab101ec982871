"""Wrappers seen by what they do, and every module call recorded with all its arguments.

(a) A project's own copy of flax's `ToLinen` (`ProjectToLinen`: a Linen module
that builds an NNX module, keeps its `nnx.split` state in its own `params` and
calls it; not flax's class) is seen through as flax's is: correspondences are
inferred through it, the localizer names a module inside it, the calls inside
are named where it keeps their variables, and given renames are honoured where
inference cannot decide (parity/compare/bridged.py). So is a project's own
`ToNNX` (`ProjectToNNX`), and flax's inside `nnx.scan`, whose copies keep their
tags.

(b) Each call is recorded with every array it is given, wherever it stands, and
public methods other than `__call__` are calls too: a bug in a parent between
two Einsum-like children (`__call__(self, eqn, x)`) is the parent's, a bug in
`Embedder.decode` is named with its method, and an argument made otherwise (a
mask) names the module that made it, not the one that received it
(parity/compare/localize/).

(c) Inside stacks whose layer sits behind the wrapper copy (Linen `nn.scan`,
rematerialised or not, against `nnx.scan` or `jax.lax.scan` over `nnx.split`
state, rematerialised or not), the localizer names the layer and the module in
it, forward and backward.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import parity
from parity.compare import localize
from parity.core import rng
from parity.pairs import correspond
from parity.pairs.stock import StockLinen, StockNnx


class ProjectToLinen(nn.Module):
  """A project's own ToLinen (as MaxText keeps one), not flax's: builds `nnx_class(*args)`,
  keeps its state in its `params` as nested dicts (under `under`, if given), and calls it."""

  nnx_class: Any
  args: tuple = ()
  under: str | None = None

  @nn.compact
  def __call__(self, *args):
    key = self.make_rng('params') if self.is_initializing() else jax.random.key(0)
    graphdef, state = nnx.split(self.nnx_class(*self.args, rngs=nnx.Rngs(params=key)))
    pure = nnx.to_pure_dict(state)
    if self.under is None:
      kept = {name: self.param(name, lambda _, value=value: value) for name, value in pure.items()}
    else:
      kept = self.param(self.under, lambda _: pure)
    nnx.replace_by_pure_dict(state, kept)
    return nnx.merge(graphdef, state)(*args)


def _batch(features: int = 6, out: int = 4):
  return {'x': jax.random.normal(jax.random.PRNGKey(1), (3, features)),
          'y': jax.random.normal(jax.random.PRNGKey(2), (3, out))}


def _squared_error(y, batch):
  return jnp.mean(jnp.square(y - batch['y']))


def _linen_side(model: nn.Module, inputs: Any = None) -> StockLinen:
  def create(seed):
    sample = jnp.zeros((1, 6)) if inputs is None else inputs
    params = model.init(jax.random.PRNGKey(seed), sample)['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

  def loss(params, state, batch, key):
    return _squared_error(state.apply_fn({'params': params}, batch['x']), batch)

  return StockLinen(create, None, None, loss)


def _nnx_side(build, **options) -> StockNnx:
  def create(seed):
    model = build(nnx.Rngs(params=seed))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  def loss(model, batch, key):
    return _squared_error(model(batch['x']), batch)

  return StockNnx(create, None, None, loss, **options)


def _localized(linen: StockLinen, nnx_side: StockNnx, batch: Any) -> localize.Localization:
  """Both sides localized from the Linen side's state, the NNX side's correspondence inferred
  first where it infers one (layers opened, as the battery probes)."""
  key = rng.step_key(rng.base_key(0), 0, 0)
  if nnx_side.infer_renames:
    nnx_side.adopt_correspondence(nnx_side.correspondence(linen, batch, key))
  return localize.localize_step(linen, nnx_side, linen.to_checkpoint(linen.init(0)), batch, key)


# ---------------------------------------------------------------------------
# (a) A project's own ToLinen
# ---------------------------------------------------------------------------


class Offset(nnx.Linear):
  """nnx.Linear, 1e-3 added to its output: a planted bug."""

  def __call__(self, x):
    return super().__call__(x) + 1e-3


class NnxMid(nnx.Module):
  def __init__(self, broken: bool = False, *, rngs: nnx.Rngs):
    self.up = (Offset if broken else nnx.Linear)(8, 16, rngs=rngs)
    self.down = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x)))


class LinenWrapping(nn.Module):
  """A Linen model whose middle layer is the NNX one behind `ProjectToLinen` (Linen names
  it `ProjectToLinen_0`)."""

  mid: Any = NnxMid
  broken: bool = False
  under: str | None = None

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(8)(x))
    x = ProjectToLinen(self.mid, (self.broken,) if self.broken else (), self.under)(x)
    return nn.Dense(4)(x)


class NnxModel(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, mid: Any = NnxMid):
    self.inp = nnx.Linear(6, 8, rngs=rngs)
    self.mid = mid(rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(self.mid(jnp.tanh(self.inp(x))))


def test_correspondences_are_inferred_through_a_project_copy_of_to_linen():
  """No renames: the wrapper pairs with the NNX module it runs, the modules inside keep
  their own names below it (they were unseen: `NNX mid/up (Linear): no Linen module
  matched; candidates: none`)."""
  linen, nnx_side = _linen_side(LinenWrapping()), _nnx_side(NnxModel)
  found = nnx_side.correspondence(linen, _batch(), rng.step_key(rng.base_key(0), 0, 0))
  assert found.renames.rules == (('Dense_0', 'inp'), ('ProjectToLinen_0', 'mid'), ('Dense_1', 'head')), found
  assert found.renames.to_nnx('ProjectToLinen_0/down/kernel') == 'mid/down/kernel'
  assert _localized(linen, nnx_side, _batch()).clean


def test_a_bug_inside_the_wrapped_module_is_named_at_its_inner_module():
  result = _localized(_linen_side(LinenWrapping(broken=True)), _nnx_side(NnxModel), _batch())
  assert (result.forward, result.forward_inside) == ('ProjectToLinen_0/up', False), result.lines()
  assert result.lines()[0].startswith('forward pass: first differs at module ProjectToLinen_0/up ('), result.lines()


def test_the_calls_inside_a_wrapper_are_named_where_it_keeps_their_variables():
  """A copy that keeps the NNX state one level down (`params/ProjectToLinen_0/state/up/...`):
  the calls inside are named so, as the checkpoint layout reads."""
  linen = _linen_side(LinenWrapping(under='state'))
  assert 'ProjectToLinen_0/state/up/kernel' in parity.core.paths.flatten(linen.init(0).params)
  calls = correspond.linen_calls(linen, linen.template, _batch(), rng.step_key(rng.base_key(0), 0, 0))
  assert [c.key for c in calls] == ['Dense_0', 'ProjectToLinen_0/state/up', 'ProjectToLinen_0/state/down',
                                    'ProjectToLinen_0', 'Dense_1', ''], calls


class NnxBranches(nnx.Module):
  """Two branches on the two halves of the features."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.LayerNorm(4, rngs=rngs)

  def __call__(self, x):
    return jnp.concatenate([self.a(x[:, :4]), self.b(x[:, 4:])], -1)


class NnxBranchesSwapped(nnx.Module):
  """`NnxBranches` ported with other names, its branches called in the other order (the same
  values, forward and backward): call order cannot pair both."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(4, rngs=rngs)
    self.proj = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    normed = self.norm(x[:, 4:])
    return jnp.concatenate([self.proj(x[:, :4]), normed], -1)


BRANCH_RULES = (('ProjectToLinen_0/a', 'mid/proj'), ('ProjectToLinen_0/b', 'mid/norm'))


def test_given_renames_are_honoured_inside_a_wrapper_where_inference_cannot_decide():
  linen = _linen_side(LinenWrapping(mid=NnxBranches))
  build = lambda rngs: NnxModel(rngs, NnxBranchesSwapped)  # noqa: E731
  key = rng.step_key(rng.base_key(0), 0, 0)
  with pytest.raises(correspond.CorrespondenceError, match='no (NNX|Linen) module matched'):
    _nnx_side(build).correspondence(linen, _batch(), key)
  nnx_side = _nnx_side(build, renames=parity.Renames(BRANCH_RULES))
  found = nnx_side.correspondence(linen, _batch(), key)
  assert found.renames.rules[:2] == BRANCH_RULES and ('ProjectToLinen_0', 'mid') in found.inferred, found
  result = _localized(linen, nnx_side, _batch())
  assert result.clean and not result.unmatched, result.lines()


class ProjectToNNX(nnx.Module):
  """A project's own ToNNX, not flax's: holds a Linen module and its parameters (`params`,
  nested dicts of nnx.Param: `mid/params/up/kernel`), and applies it."""

  def __init__(self, module: nn.Module, sample: jax.Array, *, rngs: nnx.Rngs):
    self.module = module
    self.params = nnx.data(jax.tree.map(nnx.Param, module.init(rngs.params(), sample)['params']))

  def __call__(self, *args):
    params = jax.tree.map(lambda p: p.get_value(), self.params, is_leaf=lambda x: isinstance(x, nnx.Param))
    return self.module.apply({'params': params}, *args)


class OffsetDense(nn.Dense):
  """nn.Dense, 1e-3 added to its output: a planted bug."""

  @nn.compact
  def __call__(self, x):
    return super().__call__(x) + 1e-3


class LinenMid(nn.Module):
  broken: bool = False

  @nn.compact
  def __call__(self, x):
    up = (OffsetDense if self.broken else nn.Dense)(16, name='up')
    return nn.Dense(8, name='down')(jnp.tanh(up(x)))


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name='head')(LinenMid(name='mid')(jnp.tanh(nn.Dense(8, name='inp')(x))))


class NnxWrappingLinen(nnx.Module):
  """`NnxModel` whose middle layer is still the Linen one, behind `ProjectToNNX`."""

  def __init__(self, rngs: nnx.Rngs, broken: bool = False):
    self.inp = nnx.Linear(6, 8, rngs=rngs)
    self.mid = ProjectToNNX(LinenMid(broken), jnp.zeros((1, 8)), rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(self.mid(jnp.tanh(self.inp(x))))


def test_a_project_copy_of_to_nnx_is_seen_through():
  """The Linen modules the copy applies are named where it keeps their parameters
  (`mid/params/up`): the inference pairs them with Linen's `mid/up`, and the localizer names
  a bug planted in one of them there (as Linen names it)."""
  linen, key = _linen_side(LinenModel()), rng.step_key(rng.base_key(0), 0, 0)
  found = _nnx_side(NnxWrappingLinen).correspondence(linen, _batch(), key)
  assert found.renames.rules == (('mid/up', 'mid/params/up'), ('mid/down', 'mid/params/down')), found
  result = _localized(linen, _nnx_side(lambda rngs: NnxWrappingLinen(rngs, broken=True)), _batch())
  assert (result.forward, result.forward_inside) == ('mid/up', False), result.lines()


class LinenLayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(8, name='up')(x))


class NnxScannedLinen(nnx.Module):
  """Flax's ToNNX of a Linen layer, made per layer by `nnx.vmap` and scanned by `nnx.scan`."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return nnx.bridge.ToNNX(LinenLayer(), rngs=rngs).lazy_init(jnp.zeros((1, 8)))

    self.layers = stacked(rngs)

  def __call__(self, x):
    return nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.layers)


def test_modules_inside_a_to_nnx_that_nnx_scan_copies_are_recorded():
  """nnx.scan's copies of a ToNNX keep its tag (an attribute the wrapper does not hand to
  Linen), so the Linen module it applies in each layer is recorded (it was not)."""
  model = NnxScannedLinen(nnx.Rngs(params=0))
  graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)))
  with localize.layers_opened():
    probe = localize.nnx_probe(lambda model, batch, key: jnp.mean(model(batch['x'])), graphdef, state,
                               {'x': jnp.ones((2, 8))}, None, parity.Renames())
  assert probe.order == ['layers/0/up', 'layers/0', 'layers/1/up', 'layers/1', 'layers/2/up', 'layers/2',
                         localize.ROOT], probe.order
  assert probe.unrecorded == ()


def _given_sides(mesh):
  rules = (('Dense_0', 'inp'), ('ProjectToLinen_0', 'mid')) + BRANCH_RULES + (('Dense_1', 'head'),)
  return (_linen_side(LinenWrapping(mid=NnxBranches)),
          _nnx_side(lambda rngs: NnxModel(rngs, NnxBranchesSwapped), renames=parity.Renames(rules),
                    infer_renames=False))


def test_parity_renames_prints_the_given_table_of_a_side_that_infers_none(tmp_path, capsys, monkeypatch):
  """`infer_renames=False`: the given renames, exit 0, nothing traced (tracing is what failed)."""
  from parity.run import cli

  def traced(*args, **kwargs):
    raise AssertionError('inferred, though the side infers no correspondences')

  monkeypatch.setattr(StockNnx, 'correspondence', traced)
  pair_file = tmp_path / 'given_pair.py'  # a pair file of its own: the plugin would collect one here
  pair_file.write_text('import parity\nfrom tests.test_wrappers_and_calls import _batch, _given_sides\n'
                       "given = parity.Pair('given', _given_sides, lambda step, split: _batch())\n")
  assert cli.main(['renames', '--pair', f'{pair_file}:given']) == 0
  out = capsys.readouterr().out
  namespace = {'parity': parity}
  exec(out.split('\n', 1)[1], namespace)  # pastes as it prints
  assert namespace['RENAMES'] == _given_sides(None)[1].renames


# ---------------------------------------------------------------------------
# (b) Every call, every argument
# ---------------------------------------------------------------------------


class LinenEinsum(nn.Module):
  """An Einsum as Gemma writes it: the equation first, the array second."""

  shape: tuple[int, ...]

  @nn.compact
  def __call__(self, eqn, x):
    return jnp.einsum(eqn, x, self.param('w', nn.initializers.normal(), self.shape))


class NnxEinsum(nnx.Module):
  def __init__(self, shape, *, rngs: nnx.Rngs, offset: float = 0.0):
    self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape))
    self.offset = offset

  def __call__(self, eqn, x):
    return jnp.einsum(eqn, x, self.w[...]) + self.offset


class LinenAttention(nn.Module):
  @nn.compact
  def __call__(self, x):
    q = LinenEinsum((6, 8), name='q_einsum')('bd,dh->bh', x)
    q = q * 8 ** -0.5
    return LinenEinsum((8, 4), name='attn_vec_einsum')('bh,hd->bd', jnp.tanh(q))


class NnxAttention(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs, scaled: bool = True, offset: float = 0.0):
    self.q_einsum = NnxEinsum((6, 8), rngs=rngs)
    self.attn_vec_einsum = NnxEinsum((8, 4), rngs=rngs, offset=offset)
    self.scaled = scaled

  def __call__(self, x):
    q = self.q_einsum('bd,dh->bh', x)
    q = q * 8 ** -0.5 if self.scaled else q  # the planted bug: the query scaling forgotten
    return self.attn_vec_einsum('bh,hd->bd', jnp.tanh(q))


class LinenAttentionModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return LinenAttention(name='attn')(x)


class NnxAttentionModel(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, **broken):
    self.attn = NnxAttention(rngs=rngs, **broken)

  def __call__(self, x):
    return self.attn(x)


def test_a_bug_in_a_parent_between_einsums_is_the_parents():
  """The query scaling forgotten in the attention's own code: the array the output einsum is
  given (its second argument) differs, so the attention is named, not its child."""
  result = _localized(_linen_side(LinenAttentionModel()),
                      _nnx_side(lambda rngs: NnxAttentionModel(rngs, scaled=False)), _batch())
  assert (result.forward, result.forward_call, result.forward_inside, result.forward_argument) == (
      'attn', 'attn/attn_vec_einsum', True, 'x'), result.lines()
  assert result.lines()[0].startswith(
      'forward pass: inside module attn, outside its submodules: the input of attn/attn_vec_einsum differs'
      ' while every earlier call agrees (its argument x: float32[3, 8]'), result.lines()


def test_a_bug_in_an_einsum_given_its_array_second_is_named_at_it():
  result = _localized(_linen_side(LinenAttentionModel()),
                      _nnx_side(lambda rngs: NnxAttentionModel(rngs, offset=1e-3)), _batch())
  assert (result.forward, result.forward_inside) == ('attn/attn_vec_einsum', False), result.lines()


class LinenEmbedder(nn.Module):
  vocab: int = 6
  dim: int = 4

  def setup(self):
    self.embedding = self.param('embedding', nn.initializers.normal(1.0), (self.vocab, self.dim))

  def encode(self, x):
    return x @ self.embedding

  def decode(self, x):
    return x @ self.embedding.T


class LinenEmbedded(nn.Module):
  @nn.compact
  def __call__(self, x):
    embedder = LinenEmbedder()
    return embedder.decode(jnp.tanh(nn.Dense(4)(embedder.encode(x))))


class NnxEmbedder(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs, broken: bool = False):
    self.embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (6, 4)))
    self.broken = broken

  def encode(self, x):
    return x @ self.embedding[...]

  def decode(self, x):
    logits = x @ self.embedding[...].T
    return logits * (1 + 2 ** -10) if self.broken else logits  # the planted bug


class NnxEmbedded(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, broken: bool = False):
    self.embedder = NnxEmbedder(rngs=rngs, broken=broken)
    self.block = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return self.embedder.decode(jnp.tanh(self.block(self.embedder.encode(x))))


def test_a_bug_in_a_method_other_than_call_is_named_with_its_method():
  """`Embedder.decode`, called by the model: a call of its own (it was not recorded, and the
  bug was the model's); the correspondences pair Linen's `LinenEmbedder_0` through its methods."""
  linen = _linen_side(LinenEmbedded())
  clean = _localized(linen, _nnx_side(NnxEmbedded), _batch(6, 6))
  assert clean.clean and not clean.unmatched, clean.lines()
  assert clean.compared_calls == 4  # encode, the block, decode, the model
  result = _localized(linen, _nnx_side(lambda rngs: NnxEmbedded(rngs, broken=True)), _batch(6, 6))
  assert (result.forward, result.forward_call, result.forward_inside) == (
      'LinenEmbedder_0', 'LinenEmbedder_0.decode', False), result.lines()
  assert result.lines()[0].startswith(
      'forward pass: first differs at module LinenEmbedder_0 (NNX: embedder), in its method decode ('), result.lines()


class LinenMasked(nn.Module):
  """Attention given a mask by keyword; its block makes the mask."""

  @nn.compact
  def __call__(self, x):
    return MaskingBlock(name='block')(x)


class MaskingBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    return MaskedAttention(name='attn')(x, mask=mask)


class MaskedAttention(nn.Module):
  @nn.compact
  def __call__(self, x, *, mask):
    h = nn.Dense(6, name='proj')(x)
    weights = jax.nn.softmax(jnp.where(mask, h @ h.T, -1e9))
    return nn.Dense(4, name='out')(weights @ h)


class NnxMaskedAttention(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.proj = nnx.Linear(6, 6, rngs=rngs)
    self.out = nnx.Linear(6, 4, rngs=rngs)

  def __call__(self, x, *, mask):
    h = self.proj(x)
    weights = jax.nn.softmax(jnp.where(mask, h @ h.T, -1e9))
    return self.out(weights @ h)


class NnxMaskingBlock(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.attn = NnxMaskedAttention(rngs=rngs)

  def __call__(self, x):
    mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool), k=1)  # the planted bug: one diagonal more
    return self.attn(x, mask=mask)


class NnxMasked(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.block = NnxMaskingBlock(rngs=rngs)

  def __call__(self, x):
    return self.block(x)


def test_an_argument_that_differs_is_reported_as_such():
  """The mask a block gives its attention (by keyword) differs: the block made it, so the
  block is named, with the argument; the attention is not (it was: `inside module
  block/attn, outside its submodules`)."""
  result = _localized(_linen_side(LinenMasked()), _nnx_side(NnxMasked), _batch())
  assert (result.forward, result.forward_call, result.forward_inside, result.forward_argument) == (
      'block', 'block/attn', True, 'mask'), result.lines()
  assert result.lines()[0].startswith(
      'forward pass: inside module block, outside its submodules: the input of block/attn differs while'
      ' every earlier call agrees (its argument mask: bool[3, 3]'), result.lines()
  assert result.first(0)['path'] == 'block'


# ---------------------------------------------------------------------------
# (c) Stacks whose layer sits behind the wrapper copy
# ---------------------------------------------------------------------------

LAYERS = 3


class Planted(nnx.Variable):
  """A planted bug's per-layer factor: state only the broken NNX side keeps."""


@jax.custom_vjp
def _cotangent_scaled(x, scale):
  return x


_cotangent_scaled.defvjp(lambda x, scale: (x, scale), lambda scale, g: (g * scale, jnp.zeros_like(scale)))


class PlantedLinear(nnx.Linear):
  """nnx.Linear; given a `Planted` factor (1 in every layer but one), its output (`forward`) or
  only its output's cotangent (`backward`) scaled by it."""

  def __call__(self, x):
    y = super().__call__(x)
    planted = getattr(self, 'planted', None)
    if planted is None:
      return y
    return y * planted[...] if self.mode == 'forward' else _cotangent_scaled(y, planted[...])


class NnxLayer(nnx.Module):
  """A scanned layer: `(x, _) -> (y, None)`, as `nn.scan` calls it."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.up = PlantedLinear(8, 8, rngs=rngs)
    self.down = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x, _=None):
    return self.down(jnp.tanh(self.up(x))), None


class LinenWrappedStack(nn.Module):
  """Linen `nn.scan` (over `nn.remat`, with `remat`) of `ProjectToLinen(NnxLayer)`."""

  remat: bool = False

  @nn.compact
  def __call__(self, x):
    layer = nn.remat(ProjectToLinen, prevent_cse=False) if self.remat else ProjectToLinen
    stack = nn.scan(layer, variable_axes={'params': 0}, split_rngs={'params': True}, length=LAYERS)
    x, _ = stack(NnxLayer, name='layers')(jnp.tanh(nn.Dense(8, name='inp')(x)), None)
    return nn.Dense(4, name='head')(x)


class NnxStack(nnx.Module):
  """`nnx.vmap`-made layers, scanned by `nnx.scan` or by `jax.lax.scan` over their `nnx.split`
  state, each rematerialised (`nnx.remat`, `jax.checkpoint`) or not."""

  def __init__(self, rngs: nnx.Rngs, style: str):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return NnxLayer(rngs=rngs)

    self.inp = nnx.Linear(6, 8, rngs=rngs)
    self.layers = stacked(rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)
    self.style = style

  def __call__(self, x):
    x = jnp.tanh(self.inp(x))
    if self.style.startswith('nnx.scan'):
      step = lambda x, layer: layer(x)[0]  # noqa: E731
      step = nnx.remat(step) if 'remat' in self.style else step
      x = nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.layers)
    else:
      graphdef, state = nnx.split(self.layers)

      def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x)[0], None

      body = jax.checkpoint(body) if 'checkpoint' in self.style else body
      x, _ = jax.lax.scan(body, x, state)
    return self.head(x)


def _planted_stack(style: str, mode: str):
  def build(rngs):
    model = NnxStack(rngs, style)
    model.layers.up.mode = mode
    model.layers.up.planted = Planted(jnp.ones((LAYERS,)).at[1].set(1 + 2 ** -10 if mode == 'forward' else 1.5))
    return model

  return _nnx_side(build, nnx_only=(nnx.RngState, Planted))


@pytest.mark.parametrize('linen_remat,style', [
    (False, 'nnx.scan'), (True, 'nnx.scan(nnx.remat)'),
    (False, 'jax.lax.scan'), (True, 'jax.lax.scan(jax.checkpoint)')])
def test_a_layer_behind_a_wrapper_copy_is_named_with_its_module_forward_and_backward(linen_remat, style):
  """Layer 1's `up` planted on the NNX side: its output scaled (the forward), or only its
  output's cotangent (the backward); the localizer names `layers/1/up` (it stopped at
  `layers/1`, the wrapper, whose inside it did not see)."""
  linen = _linen_side(LinenWrappedStack(linen_remat))
  forward = _localized(linen, _planted_stack(style, 'forward'), _batch())
  assert (forward.forward, forward.forward_inside, forward.unrecorded) == ('layers/1/up', False, ()), forward.lines()
  assert (forward.first(0)['path'], forward.first(0)['layer']) == ('layers/up', 1)
  backward = _localized(linen, _planted_stack(style, 'backward'), _batch())
  assert backward.forward is None and backward.backward[0][0] == 'layers/1/up', backward.lines()
  assert backward.lines()[1].startswith(
      'backward pass: inside module layers/1/up: output cotangent bitwise equal, gradients differ:'
      ' params/layers/up/bias (layer 1: '), backward.lines()
