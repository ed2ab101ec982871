"""The fourth family, as a user would declare it: a stock-layer causal language model with
dropout on, no renames (inferred), no probe override, no wrapper around `create`.

The glue a user writes for the whole battery is the block between the markers.
"""
# --- glue ---
import functools

import parity
from models.families import LM_RULES, LmConfig, lm_batch
from models.linen import lm as linen_lm
from models.nnx import lm as nnx_lm

# NNX's stock attention sums its products in another layout than Linen's (other bits):
# the NNX side is given Linen's formula (parity.linen_attention), as the encoder's pair does.
CFG = LmConfig(nnx_attention='linen')


def make_sides(mesh, cfg=CFG):
  linen = parity.StockLinen(functools.partial(linen_lm.create_train_state, cfg), linen_lm.train_step,
                            linen_lm.eval_step, linen_lm.loss_fn, mesh=mesh, rules=LM_RULES,
                            forward=linen_lm.forward, decode_fn=linen_lm.decode)  # eval logits, KV cache
  nnx_side = parity.StockNnx(functools.partial(nnx_lm.create_train_state, cfg), nnx_lm.train_step,
                             nnx_lm.eval_step, nnx_lm.loss_fn, mesh=mesh, rules=LM_RULES,
                             forward=nnx_lm.forward, decode_fn=nnx_lm.decode,
                             dropout_keys='linen')  # stock dropout: Linen's make_rng keys
  return linen, nnx_side


STOCK_LAYERS_PROGRAM = parity.KnownDifference(
    paths=('LayerNorm_0',) + tuple(f'DecoderBlock_{i}/LayerNorm_{j}' for i in range(CFG.num_layers) for j in (0, 1)),
    passes=('program', 'memory'), max_changed_lines=2300, max_temp_bytes={'cpu': 256},
    reason="flax's stock layer norm lowers differently in Linen and NNX (same numbers); with dropout"
           " on, its other lowering moves 256 B of temporaries on the CPU (XLA:GPU's memory: equal)")
lm = parity.Pair('lm', make_sides, functools.partial(lm_batch, CFG), known_differences=(STOCK_LAYERS_PROGRAM,),
                 meshes=('data=4,tensor=2',), rules=LM_RULES,
                 decode=parity.Decode(prompt=lambda batch: batch['tokens'][:, :4], steps=8))
# --- end of glue ---

import dataclasses  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402


def _broken(name, create=None, cfg=CFG):
  def sides(mesh):
    linen, nnx_side = make_sides(mesh)
    return linen, dataclasses.replace(nnx_side, create=create or functools.partial(nnx_lm.create_train_state, cfg))

  return parity.Pair(name, sides, functools.partial(lm_batch, CFG), parts=('grads',))


def _with_epsilon(seed):
  model, optimizer = nnx_lm.create_train_state(CFG, seed)
  model.blocks[1].ln2.epsilon = 1e-3  # stock: 1e-6, as Linen's
  return model, optimizer


def _off_by_one(x, **kwargs):
  """A causal mask that lets each position see the next one too."""
  index = jnp.broadcast_to(jnp.arange(x.shape[-1]), x.shape)
  return nn.make_attention_mask(index, index, lambda q, k: q + 1 >= k, **kwargs)


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-lm')
@pytest.mark.parametrize('bug,module', [
    ('dropout_rate', 'DecoderBlock_0/Dropout_0'),
    # The mask is made by the model's own code and handed to each block: the model is named,
    # with the block's argument that differs.
    ('causal_mask', '(model)'),
    ('layer_norm_epsilon', 'DecoderBlock_1/LayerNorm_1'),
])
def test_a_bug_planted_in_the_nnx_side_fails_and_the_localizer_names_its_module(bug, module, monkeypatch):
  from parity.battery import checks

  if bug == 'dropout_rate':
    pair = _broken(bug, cfg=dataclasses.replace(CFG, dropout_rate=0.2))
  elif bug == 'causal_mask':
    monkeypatch.setattr(nnx, 'make_causal_mask', _off_by_one)
    pair = _broken(bug)
  else:
    pair = _broken(bug, create=_with_epsilon)
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  message = str(failure.value)
  named = (f'forward pass: first differs at module {module} (', f'forward pass: inside module {module},',
           f'forward pass: inside module {module} (NNX: ')  # its NNX path after it where that differs
  assert any(line in message for line in named), message
  if bug == 'causal_mask':
    assert 'the input of DecoderBlock_0 (NNX: blocks/0) differs' in message and 'mask' in message, message


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-lm')
def test_stock_dropout_without_linens_keys_fails_naming_both_key_schemes():
  """The same pair with NNX drawing its own keys from the Rngs passed at the call: the masks
  differ from the first dropout; the localizer names it and says how to make the keys equal."""
  from parity.battery import checks

  def sides(mesh):
    linen, nnx_side = make_sides(mesh)
    return linen, dataclasses.replace(nnx_side, dropout_keys='nnx')

  pair = parity.Pair('nnx_keys', sides, functools.partial(lm_batch, CFG), parts=('grads',))
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  message = str(failure.value)
  assert 'first differs at module DecoderBlock_0/Dropout_0' in message, message
  assert "stock Linen draws make_rng('dropout')" in message and "dropout_keys='linen'" in message, message


def _skip_slot(at: int):
  """Each NNX attention's cache index jumps one slot when it reaches `at` (from the start: 0)."""
  init_cache, call = nnx.MultiHeadAttention.init_cache, nnx.MultiHeadAttention.__call__

  def init_off_by_one(self, *args, **kwargs):
    init_cache(self, *args, **kwargs)
    self.cache_index[...] = self.cache_index[...] + 1

  def call_skipping(self, *args, **kwargs):
    if self.decode:
      index = self.cache_index[...]
      self.cache_index[...] = jnp.where(index == at, index + 1, index)
    return call(self, *args, **kwargs)

  return ('init_cache', init_off_by_one) if at == 0 else ('__call__', call_skipping)


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-lm')
@pytest.mark.parametrize('at,step,where', [
    (0, 0, 'in model call 0 of 11: the prefill (model call 0 of its 4)'),  # prompt of 4, 8 steps
    (6, 3, 'in model call 6 of 11: decode step 3 of 8 (it feeds token 2)'),
])
def test_an_nnx_cache_index_off_by_one_fails_the_decode_part_naming_the_module_and_step(monkeypatch, at, step, where):
  """The NNX attentions' cache index skips a slot (from the start, or mid-decode): the decode
  part fails from the step whose logits it changes, and the decode localizer names the first
  attention module and the model call (prefill or decode step) where it first differs."""
  from parity.battery import checks

  monkeypatch.setattr(nnx.MultiHeadAttention, *_skip_slot(at))
  pair = dataclasses.replace(lm, name=f'cache_skips_slot_{at}', parts=('decode',))
  jax.clear_caches()  # the decode steps are jitted at module level: traced again with the bug
  try:
    with pytest.raises(AssertionError) as failure:
      checks.check_decode(pair, 'one_device')
  finally:
    jax.clear_caches()  # and without it, for the tests after this one
  message = str(failure.value)
  assert f'first differing decode step: {step} of 8' in message, message
  assert ('decode localizer: first differs inside module DecoderBlock_0/MultiHeadDotProductAttention_0'
          ' (NNX: blocks/0/attention), outside its submodules (the input of'
          ' DecoderBlock_0/MultiHeadDotProductAttention_0/out (NNX: blocks/0/attention/out)'
          f' differs), {where}') in message, message


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-lm')
def test_a_cache_placed_otherwise_on_the_mesh_fails_the_decode_part():
  """The same values, NNX's cache arrays moved to another sharding (batch over `tensor`): the
  decode part fails on the mesh naming them."""
  from parity.battery import checks

  def decode_elsewhere(model, *args):
    tokens, logits, cache = nnx_lm.decode(model, *args)
    elsewhere = jax.sharding.NamedSharding(tokens.sharding.mesh, jax.sharding.PartitionSpec('tensor'))
    return tokens, logits, {p: jax.device_put(x, elsewhere) if x.ndim else x for p, x in cache.items()}

  def sides(mesh):
    linen, nnx_side = make_sides(mesh)
    return linen, dataclasses.replace(nnx_side, decode_fn=decode_elsewhere)

  pair = dataclasses.replace(lm, name='cache_elsewhere', make_sides=sides, parts=('decode',))
  with pytest.raises(AssertionError) as failure:
    checks.check_decode(pair, 'data=4,tensor=2')
  message = str(failure.value)
  assert 'the decoded caches are placed otherwise on data=4,tensor=2 (4 of 6 arrays)' in message, message
  assert ("cached_key: Linen ('data', None, 'tensor'), NNX ('tensor',)" in message), message


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-lm')
def test_an_undeclared_stock_lowering_is_named_with_the_declaration_to_write():
  """The program part, failing on a pair that declares nothing, tries flax's stock layers that
  lower otherwise: the fewest kinds whose modules, left out, leave the programs identical are
  named, with the declaration and its measured bound."""
  from parity.battery import checks

  with pytest.raises(AssertionError) as failure:
    checks.check_program(dataclasses.replace(lm, known_differences=()))
  message = str(failure.value)
  assert "the programs are identical outside flax's stock LayerNorm (5 modules)" in message, message
  declared = message.split('parity.KnownDifference(', 1)[1].splitlines()[0]
  assert all(repr(path) in declared for path in STOCK_LAYERS_PROGRAM.paths), declared
  assert 'MultiHeadDotProductAttention' not in declared, declared  # given Linen's formula: the same program


ATTENTION_DROPOUT = dataclasses.replace(CFG, attention_dropout_rate=0.1)


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-lm')
@pytest.mark.parametrize('scheme', ['linen', 'nnx'])
def test_the_stock_attentions_own_dropout_draws_linens_keys_too(scheme):
  """Attention dropout (of the weights, inside flax's stock attention; Rngs at the call): with
  Linen's keys the gradients are bit for bit; with NNX's own, the localizer names the first
  attention, says why and gives the fix."""
  from parity.battery import checks

  def sides(mesh):
    linen, nnx_side = make_sides(mesh, cfg=ATTENTION_DROPOUT)
    return linen, dataclasses.replace(nnx_side, dropout_keys=scheme)

  pair = parity.Pair(f'attention_dropout_{scheme}', sides, functools.partial(lm_batch, ATTENTION_DROPOUT),
                     parts=('grads',))
  if scheme == 'linen':
    checks.check_grads(pair)
    return
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  message = str(failure.value)
  module = 'DecoderBlock_0/MultiHeadDotProductAttention_0'
  assert any(line in message for line in (f'first differs at module {module} (', f'inside module {module},',
                                          f'inside module {module} (NNX: ')), message
  assert "flax's stock attention with its own dropout (rate 0.1)" in message, message
  assert "dropout_keys='linen'" in message and 'scales' not in message, message
