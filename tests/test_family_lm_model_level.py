"""The language-model family through the model-level API: the two model classes (models/linen/lm.py,
models/nnx/lm.py), a loss and an optimizer; the kit writes both sides' create, train, eval, forward
and decoding (`parity.model_pair`, parity/pairs/model_level.py), none of the family's step functions.

Stock dropout and the stock attention's own dropout are on, bit for bit (the kit's NNX side draws
Linen's keys), and decoding drives flax's `decode=True` KV cache on both sides. The glue a user
writes for the whole battery is the block between the markers.
"""
# --- glue ---
import parity
from models.families import LM_RULES, LmConfig, lm_batch
from models.linen import lm as linen_lm
from models.nnx import lm as nnx_lm

CFG = LmConfig(attention_dropout_rate=0.1)  # stock attention on both sides, its own dropout on
# flax's stock layer norms lower otherwise in Linen and NNX, with the same numbers (as in tests/test_family_lm.py)
NORMS = ('LayerNorm_0', *(f'DecoderBlock_{i}/LayerNorm_{j}' for i in range(CFG.num_layers) for j in (0, 1)))
LN = parity.KnownDifference(NORMS, ('program', 'memory'), 'stock lowering', max_changed_lines=2300, max_temp_bytes={'cpu': 256})
lm_model_level = parity.model_pair(
    'lm_model_level', linen=linen_lm.LanguageModel(CFG), nnx=lambda rngs: nnx_lm.LanguageModel(CFG, rngs=rngs),
    inputs=lambda b: b['tokens'][:, :-1], loss=lambda logits, b: linen_lm.next_token_loss(logits, b['tokens']),
    optimizer=linen_lm.make_optimizer(CFG), batch=lambda step, split: lm_batch(CFG, step, split), rules=LM_RULES,
    meshes=('data=4,tensor=2',), decode=parity.Decode(prompt=lambda b: b['tokens'][:, :4]), known_differences=(LN,))
# --- end of glue ---

import functools  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from flax.core import meta  # noqa: E402

from parity.core import compat  # noqa: E402

GLUE_MAX_LINES = 12


def test_the_glue_is_at_most_twelve_lines():
  """The block between the markers, blank lines and comments left out: the model-level API's measure."""
  source = pathlib.Path(__file__).read_text()
  glue = source.split('# --- glue ---\n', 1)[1].split('# --- end of glue ---', 1)[0]
  lines = [line for line in glue.splitlines() if line.strip() and not line.strip().startswith('#')]
  assert len(lines) <= GLUE_MAX_LINES, '\n'.join(lines)


def test_decode_loop_feeds_the_prompt_then_each_drawn_token_but_the_last():
  """`parity.decode_loop` around a toy call recording what it is fed: the prompt, then each token but the last."""
  vocab = 8

  def call(tokens, cache):
    fed = tokens if cache is None else jnp.concatenate([cache, tokens], axis=1)
    logits = jax.nn.one_hot((tokens + 1) % vocab, vocab)  # the next token is one more
    return logits, fed

  prompt = jnp.asarray([[1, 2, 3], [5, 6, 7]], jnp.int32)
  tokens, logits, cache = parity.decode_loop(call, prompt, 4, jax.random.PRNGKey(0), 0.0)
  assert tokens.tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]
  assert logits.shape == (2, 4, vocab) and logits.dtype == jnp.float32
  assert cache.tolist() == [[1, 2, 3, 4, 5, 6], [5, 6, 7, 0, 1, 2]]  # prompt + steps - 1 fed
  one_token = parity.decode_loop(lambda t, c: (call(t, None)[0], (c or 0) + 1), prompt, 4, jax.random.PRNGKey(0), 0.0,
                                 one_token=True)
  assert one_token[0].tolist() == tokens.tolist() and one_token[2] == 3 + 3  # 3 prompt calls, 3 tokens fed


def test_the_kit_writes_boxed_linen_params_and_decodes_on_a_copy_of_the_nnx_model():
  """Linen's `create` keeps `init`'s boxes; NNX decoding runs on a copy, leaving no `nnx.Cache` in the model."""
  linen, nnx_side = lm_model_level.make_sides(None)
  params = linen.create(0).params
  assert isinstance(params['Embed_0']['embedding'], nn.LogicallyPartitioned)  # as annotated
  assert not isinstance(params['LayerNorm_0']['scale'], meta.AxisMetadata)  # not annotated: plain
  with compat.eager_sharding_off():  # the model annotates mesh axes: built without a mesh, as the kit does
    model, _ = nnx_side.create(0)
  before = nnx.graphdef(model)
  tokens, logits, cache = nnx_side.decode_fn(model, jnp.ones((2, 3), jnp.int32), 2, jax.random.PRNGKey(0), 0.0)
  assert tokens.shape == (2, 2) and logits.shape == (2, 2, CFG.vocab_size)
  assert sorted(cache) == sorted(f'blocks/{i}/attention/{name}' for i in range(CFG.num_layers)
                                 for name in ('cache_index', 'cached_key', 'cached_value'))
  assert not nnx.state(model, nnx.Cache) and nnx.graphdef(model) == before and not model.decode


def test_the_kits_flax_cache_decoders_decode_as_the_familys_own_decode_bit_for_bit():
  """`parity.linen_decoder` and `parity.nnx_decoder` against the family's hand-written decode: same bits."""
  from parity.core import bitwise

  state = linen_lm.create_train_state(CFG, 0)
  with compat.eager_sharding_off():
    model, _ = nnx_lm.create_train_state(CFG, 0)
  prompt, key = jnp.asarray(lm_batch(CFG, 0, 'eval')['tokens'][:, :4]), jax.random.PRNGKey(3)
  for temperature in (0.0, 0.8):
    for own, kit, of in ((linen_lm.decode, parity.linen_decoder(kwargs={'train': False}), state),
                         (nnx_lm.decode, parity.nnx_decoder(kwargs={'train': False}), model)):
      expected, got = own(of, prompt, 8, key, temperature), kit(of, prompt, 8, key, temperature)
      for what, a, b in zip(('tokens', 'logits', 'cache'), expected, got):
        assert bitwise.bitwise_equal(a, b), (own.__module__, temperature, what)


# -- any other cache: one call per side, `(tokens, cache) -> (logits, cache)` -----------------------

MAX_LEN = 16  # the calls' own cache length (more than the prompt and the steps)
DECODING = linen_lm.LanguageModel(CFG, decode=True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _linen_cache(batch, max_len):
  return DECODING.init(jax.random.PRNGKey(0), jnp.zeros((batch, max_len), jnp.int32))['cache']


@jax.jit
def _linen_token(variables, cache, token_B1):
  logits, mutated = DECODING.apply({**variables, 'cache': cache}, token_B1, mutable=['cache'])
  return logits, mutated['cache']


def linen_call(variables, tokens, cache, max_len=MAX_LEN):
  """A cache of the user's own making: flax's, made and fed by hand, one token a call, as long as
  the kit says decoding needs (`max_len`)."""
  if cache is None:
    cache = _linen_cache(tokens.shape[0], max_len)
  for i in range(tokens.shape[1]):
    logits, cache = _linen_token(variables, cache, tokens[:, i:i + 1])
  return logits, cache


@nnx.jit
def _nnx_token(model, token_B1):
  return model(token_B1)


def nnx_call(model, tokens, cache, skip_at=None, max_len=MAX_LEN):
  """The NNX side's: its caches made by hand in the (copied) model, fed one token a call."""
  if cache is None:
    model.init_cache(tokens.shape[0], max_len)
    model.set_attributes(decode=True)
  for i in range(tokens.shape[1]):
    if skip_at is not None and int(model.blocks[0].attention.cache_index[...]) == skip_at:
      for block in model.blocks:
        block.attention.cache_index[...] += 1  # a planted bug: a slot skipped
    logits = _nnx_token(model, tokens[:, i:i + 1])
  return logits, nnx.state(model, nnx.Cache)


def _own_cache_pair(name, nnx_call=nnx_call):
  return parity.model_pair(
      name, linen=linen_lm.LanguageModel(CFG), nnx=lambda rngs: nnx_lm.LanguageModel(CFG, rngs=rngs),
      inputs=lambda b: b['tokens'][:, :-1], loss=lambda logits, b: linen_lm.next_token_loss(logits, b['tokens']),
      optimizer=linen_lm.make_optimizer(CFG), batch=lm_model_level.batch, decode=lm_model_level.decode,
      cache_calls=(linen_call, nnx_call), parts=('decode',))


@pytest.mark.xdist_group('parity-lm_model_level/own-programs')  # with the pair's decode parts
def test_a_cache_of_ones_own_is_driven_by_the_same_loop():
  """`cache_calls=(linen call, nnx call)`: each side's one call, driven greedy and sampled, bit for bit."""
  from parity.battery import checks

  pair = _own_cache_pair('lm_own_cache')
  lines = checks.check_decode(pair, 'one_device')
  assert [line for line in lines if '8 tokens, their logits and 6 cache arrays bit for bit' in line] == [
      'greedy, one_device: 8 tokens, their logits and 6 cache arrays bit for bit',
      'temperature 0.8, one_device: 8 tokens, their logits and 6 cache arrays bit for bit'], lines
  runs = checks._runs(pair)
  prompt = runs.batch(0, 'eval')['tokens'][:, :4]
  for side in runs.sides():  # each call was told the length decoding needs: 4 prompt tokens and 8 steps
    out = side.decode(side.from_checkpoint(runs.start('linen')), prompt, 8, jax.random.PRNGKey(0), 0.0)
    assert {x.shape[1] for p, x in out['cache'].items() if p.endswith('cached_key')} == {12}, side.name


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-lm_model_level/own-programs')
def test_a_slot_ones_own_cache_skips_fails_from_that_step_naming_the_attention():
  """A slot the NNX call skips mid-decode: the decode part fails from that step, naming the attention."""
  from parity.battery import checks

  skipping = _own_cache_pair('lm_own_cache_skips', lambda *args, max_len: nnx_call(*args, skip_at=6, max_len=max_len))
  with pytest.raises(AssertionError) as failure:
    checks.check_decode(skipping, 'one_device')
  message = str(failure.value)
  assert 'first differing decode step: 3 of 8' in message, message
  module = 'DecoderBlock_0/MultiHeadDotProductAttention_0'
  assert (f'decode localizer: first differs inside module {module} (NNX: blocks/0/attention), outside its'
          f' submodules (the input of {module}/out (NNX: blocks/0/attention/out) differs), in model call 6 of 11:'
          ' decode step 3 of 8 (it feeds token 2)') in message, message


@pytest.mark.xdist_group('parity-lm_model_level/own-programs')  # the decode parts' programs
def test_the_kits_decoders_lower_one_step_whose_memory_compare_decode_compares():
  """Each side's decoding step, as the kit's decoders run it (parameters and cache in, logits and
  cache out), lowered for `parity compare --decode`: its memory equal to the byte."""
  from parity.battery import checks
  from parity.run import runner

  runs = checks._runs(lm_model_level)
  sides = dict(zip(('linen', 'nnx'), runs.sides()))
  start = runs.start('linen')
  states = {name: side.from_checkpoint(start) for name, side in sides.items()}
  prompt = runs.batch(0, 'eval')['tokens'][:, :4]
  run = runner.decode_sides(sides, states, prompt, 2, jax.random.PRNGKey(3), 0.0)
  assert not run.diffs
  assert run.memory['linen']['output_bytes'] > 0 and run.memory['linen'] == run.memory['nnx'], run.memory
  assert run.memory_verdict() == 'equal to the byte'
  assert run.program is None and run.program_verdict().endswith('its memory is compared)')


@pytest.mark.xdist_group('parity-lm_model_level/own-programs')
def test_a_cache_of_ones_own_is_lowered_alike_on_both_sides_for_compare_decode():
  """`cache_calls`: each side's call lowered as a function of what it is given (variables or the
  model's state, tokens, cache) returning logits and cache, so the memory compared is the same
  program's (NNX's step lowered with nnx.jit returned the model's state too: +85,544 B of output)."""
  from parity.battery import checks
  from parity.run import runner

  pair = _own_cache_pair('lm_own_cache_lowered')
  runs = checks._runs(pair)
  sides = dict(zip(('linen', 'nnx'), runs.sides()))
  start = runs.start('linen')
  states = {name: side.from_checkpoint(start) for name, side in sides.items()}
  run = runner.decode_sides(sides, states, runs.batch(0, 'eval')['tokens'][:, :4], 2, jax.random.PRNGKey(3), 0.0)
  assert not run.diffs
  assert run.memory['linen']['output_bytes'] > 0 and run.memory['linen'] == run.memory['nnx'], run.memory
  assert run.memory_verdict() == 'equal to the byte'


class _Subclassed(linen_lm.LanguageModel):
  """A user's subclass of the Linen model whose `__call__` calls `super().__call__`."""

  def __call__(self, tokens, train: bool = False):
    return super().__call__(tokens, train=train)


@pytest.mark.xdist_group('parity-lm_model_level/own-programs')
def test_a_linen_subclass_calling_super_is_compared_as_the_model_itself():
  """The subclass enters the root's name scope twice in Linen's debug locations; the program part
  still finds the declared norms and passes under the pair's declaration, as the model's own."""
  from parity.battery import checks

  pair = parity.model_pair(
      'lm_subclassed', linen=_Subclassed(CFG), nnx=lambda rngs: nnx_lm.LanguageModel(CFG, rngs=rngs),
      inputs=lambda b: b['tokens'][:, :-1], loss=lambda logits, b: linen_lm.next_token_loss(logits, b['tokens']),
      optimizer=linen_lm.make_optimizer(CFG), batch=lm_model_level.batch, rules=LM_RULES, known_differences=(LN,),
      parts=('program',))
  (line,) = checks.check_program(pair)
  assert line.endswith('identical outside those modules'), line


@pytest.mark.xdist_group('parity-lm_model_level/own-programs')
def test_an_attention_dropout_rate_on_one_side_only_is_named_as_a_rate_not_a_formula():
  """The NNX attention planted with dropout_rate 0.0 (Linen's 0.1): the grads part fails at the
  attention, naming the rates, and offers no stock-formula substitute (no substitute makes two
  rates agree)."""
  import dataclasses

  from parity.battery import checks

  no_rate = dataclasses.replace(CFG, attention_dropout_rate=0.0)
  pair = parity.model_pair(
      'lm_attention_rate', linen=linen_lm.LanguageModel(CFG), nnx=lambda rngs: nnx_lm.LanguageModel(no_rate, rngs=rngs),
      inputs=lambda b: b['tokens'][:, :-1], loss=lambda logits, b: linen_lm.next_token_loss(logits, b['tokens']),
      optimizer=linen_lm.make_optimizer(CFG), batch=lm_model_level.batch, rules=LM_RULES, parts=('grads',))
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  message = str(failure.value)
  assert ("DecoderBlock_0/MultiHeadDotProductAttention_0: the attentions' dropout rates differ: Linen's draws"
          " dropout masks in train mode (make_rng('dropout') in its scope), the NNX attention's dropout_rate is"
          " 0.0") in message, message
  assert 'linen_attention' not in message, message
