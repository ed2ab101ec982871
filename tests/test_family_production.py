"""The fifth family, as a production team would declare it, on the idioms of the seeds' migration:

* the Linen side's layers scanned and rematerialised (`nn.scan(nn.remat(Block))`), their MLP an
  NNX module behind the project's own copy of a ToLinen wrapper (models/linen/nnx_wrappers.py),
  which the kit sees through by what it does;
* the NNX side's `nnx.vmap`-made layers run by `jax.lax.scan` over their `nnx.split` state under
  `jax.checkpoint`;
* dropout 0.1 drawn from `make_rng` on Linen and from streams the NNX model keeps (stacked per
  layer), given Linen's keys by the kit (`dropout_keys='linen'`), with no change to the model;
* remat `full` (`production`) and `save_dots` (`production_save_dots`);
* logical axis names on every parameter and activation, 75 rules, a 5-axis mesh of its own.

No renames, no probe, no inferred correspondence turned off. The glue a user writes for the
whole battery is the block between the markers.
"""
# --- glue ---
import functools

import parity
from models.families import PROD_RULES, ProdConfig, prod_batch, prod_mesh
from models.linen import prod as linen_prod
from models.nnx import prod as nnx_prod

CFG = ProdConfig()
CFG_DOTS = ProdConfig(remat_policy='save_dots')


def make_sides(mesh, cfg=CFG):
  common = dict(mesh=mesh, rules=PROD_RULES)
  linen = parity.StockLinen(functools.partial(linen_prod.create_train_state, cfg), linen_prod.train_step,
                            linen_prod.eval_step, linen_prod.loss_fn, forward=linen_prod.forward, **common)
  nnx_side = parity.StockNnx(functools.partial(nnx_prod.create_train_state, cfg), nnx_prod.train_step,
                             nnx_prod.eval_step, nnx_prod.loss_fn, forward=nnx_prod.forward,
                             dropout_keys='linen', **common)  # its model-held streams draw Linen's keys
  return linen, nnx_side


# Its NNX training saves in Linen's on-disk tree plus `nnx_aux` (models/nnx/prod.py, checkpoint_tree).
production = parity.Pair('production', make_sides, functools.partial(prod_batch, CFG), mesh_factory=prod_mesh,
                         meshes=('data=2,stage=1,fsdp=2,sequence=1,tensor=2',),
                         saves={'nnx': nnx_prod.checkpoint_tree})
# The other remat policy: each layer keeps its dots.
production_save_dots = parity.Pair(
    'production_save_dots', functools.partial(make_sides, cfg=CFG_DOTS), functools.partial(prod_batch, CFG_DOTS),
    mesh_factory=prod_mesh, meshes=('data=2,stage=1,fsdp=2,sequence=1,tensor=2',))
# --- end of glue ---

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from parity.battery import checks  # noqa: E402


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-production')
def test_streams_carried_through_the_scan_are_accounted_with_what_they_add():
  """Dropout off, the NNX model carrying its dropout streams through the scan anyway (the 18
  stream leaves in and out of the forward loop: each of the three dropouts' forked nnx.Rngs
  holds three streams, a key and a count each): the memory part compares NNX's step without the
  streams, as the program part does, and passes; its accounting line says what they add to the
  step that carries them, 288 B of temporaries among it (36 more entries of 8 B in the forward
  while loop's tuple, read in XLA's buffer assignment)."""
  cfg = dataclasses.replace(CFG, dropout_rate=0.0)

  def create(seed):
    model, optimizer = nnx_prod.create_train_state(cfg, seed)
    model.streams_advance = lambda train: True  # another graphdef: traced anew
    return model, optimizer

  def sides(mesh):
    linen, nnx_side = make_sides(mesh, cfg)
    return linen, dataclasses.replace(nnx_side, create=create)

  pair = parity.Pair('production_streams_carried', sides, functools.partial(prod_batch, cfg),
                     parts=('memory', 'program'))
  (line,) = checks.check_memory(pair)
  assert "NNX's step compared without it, as the program part compares it" in line, line
  assert 'temp_bytes +288 B' in line, line
  assert checks.check_program(pair) == []


def test_the_nnx_dropouts_keep_whole_forked_rngs_of_several_streams_in_the_codebases_own_subclass():
  """What the pair proves is held as production NNX code holds it: each dropout is the model's own
  subclass of nnx.Dropout keeping a fork of the whole nnx.Rngs (params, dropout and noise
  streams), stacked per layer, made by the model's own helper."""
  from flax import nnx

  from parity.core import compat

  with compat.eager_sharding_off():
    model = nnx.eval_shape(lambda: nnx_prod.create_train_state(CFG, 0)[0])
  for dropout in (model.layers.attention_dropout, model.layers.mlp.dropout, model.layers.mlp_dropout):
    assert type(dropout) is nnx_prod.Dropout and issubclass(nnx_prod.Dropout, nnx.Dropout)
    assert isinstance(dropout.rngs, nnx.Rngs), type(dropout.rngs)
    assert sorted(name for name, _ in dropout.rngs.items()) == ['dropout', 'noise', 'params']
    assert dropout.rngs.dropout.key.shape == (CFG.num_layers,)
  assert CFG.dropout_rate > 0


@pytest.mark.xdist_group('parity-production/planted')
def test_the_nnx_streams_drawing_their_own_keys_fail_naming_the_dropout_and_the_fix():
  """The NNX side left to draw its own keys (`dropout_keys='nnx'`): the grads part fails at
  layer 0's first dropout, named on both sides, with the fix that needs no change to the
  model (the kit seeds the streams it keeps), not a change to both models."""
  message = _grads_failure('production_own_keys', dropout_keys='nnx')
  assert 'forward pass: first differs at module layers/0/attention_dropout (' in message, message
  assert ('layers/attention_dropout draws its dropout mask from an RNG stream the NNX model keeps'
          ' (layers/attention_dropout/rngs)') in message, message
  assert "StockNnx(..., dropout_keys='linen') seeds the streams the model keeps" in message, message
  assert 'pass it at the call on both sides' not in message, message


def _grads_failure(name: str, **nnx_changes) -> str:
  """The grads part's failure on the production pair with its NNX side changed (`dataclasses.replace`)."""
  def sides(mesh):
    linen, nnx_side = make_sides(mesh)
    return linen, dataclasses.replace(nnx_side, **nnx_changes)

  with pytest.raises(AssertionError) as failure:
    checks.check_grads(parity.Pair(name, sides, production.batch, parts=('grads',)))
  return str(failure.value)


class _OwnKey(nnx_prod.Dropout):
  """A planted bug: the dropout draws a key it derives itself from its stream, at the call."""

  def __call__(self, inputs, *, deterministic=None, rngs=None):
    import jax

    return super().__call__(inputs, deterministic=deterministic, rngs=jax.random.fold_in(self.rngs.dropout(), 7))


@pytest.mark.xdist_group('parity-production/planted')
def test_a_dropout_drawing_a_key_it_derived_itself_fails_naming_the_dropout_and_the_key():
  """The layers' MLP dropout planted to draw `fold_in(its stream's key, 7)` passed at the call (the
  NNX model deriving its own key): the kit leaves that draw as drawn, and the grads part fails
  at layer 0's, saying it was given a key array at the call, not what it keeps."""
  def create(seed):
    model, optimizer = nnx_prod.create_train_state(CFG, seed)
    model.layers.mlp_dropout.__class__ = _OwnKey
    return model, optimizer

  message = _grads_failure('production_own_key', create=create)
  assert 'forward pass: first differs at module layers/0/mlp_dropout (' in message, message
  assert ('layers/mlp_dropout keeps an RNG stream (layers/mlp_dropout/rngs) but was called with a key'
          ' array at the call (_OwnKey got a typed key, key<fry>[])') in message, message


@pytest.mark.xdist_group('parity-production/planted')
def test_the_mlps_own_dropout_deriving_its_key_fails_naming_the_dropout_behind_linens_wrapper():
  """The MLP's dropout (the one the Linen side runs behind its ToLinen copy, drawing from streams
  the wrapper makes of Linen's key) planted on the NNX side to draw a key it derives itself: the
  grads part fails at that dropout, layer 0's, so the kit does reach it and no key of its making
  hides a bug there."""
  def create(seed):
    model, optimizer = nnx_prod.create_train_state(CFG, seed)
    model.layers.mlp.dropout.__class__ = _OwnKey
    return model, optimizer

  message = _grads_failure('production_mlp_own_key', create=create)
  assert 'forward pass: first differs at module layers/0/mlp/dropout (' in message, message
  assert 'layers/mlp/dropout keeps an RNG stream (layers/mlp/dropout/rngs) but was called with a key' in message
