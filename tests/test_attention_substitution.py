"""flax's stock attentions, Linen's against NNX's, with no change to either model.

`nn.MultiHeadDotProductAttention` and `nnx.MultiHeadAttention`, each left with flax's defaults,
round otherwise (benchmarks/attention_rounding.py; docs/howto-differences.md, "Stock attention"). Declared
with the kit's stand-in as its substitute, the kit gives the NNX model's stock attention Linen's
formula in every part (train, eval, checkpoints, mesh, memory, program, the localizer), and the
pair declared here passes its whole battery bit for bit (the plugin generates it). Undeclared, the
grads part fails, and its hint prints that very declaration; a declaration that cannot take
effect fails saying so.
"""
# --- pair ---
import flax.linen as nn
import numpy as np
import optax
from flax import nnx

import parity

HEADS = 2


class LinenAttention(nn.Module):
  head_dim: int = 8
  rate: float = 0.0  # the attention's own dropout

  @nn.compact
  def __call__(self, x, train: bool = False):
    h = nn.Dense(HEADS * self.head_dim)(x)
    h = h + nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=self.rate)(h, deterministic=not train)
    return nn.Dense(4)(h.mean(1))


class NnxAttention(nnx.Module):

  def __init__(self, head_dim: int = 8, rate: float = 0.0, *, rngs: nnx.Rngs):
    features = HEADS * head_dim
    self.embed = nnx.Linear(8, features, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(HEADS, features, dropout_rate=rate, decode=False, rngs=rngs)
    self.head = nnx.Linear(features, 4, rngs=rngs)

  def __call__(self, x, train: bool = False, rngs: nnx.Rngs | None = None):
    h = self.embed(x)
    h = h + self.attention(h, deterministic=not train, rngs=rngs)
    return self.head(h.mean(1))


def batch(step: int, split: str) -> dict[str, np.ndarray]:
  """8 sequences of 8 positions of 8 features, labelled by the sign of their sum."""
  rng = np.random.default_rng([step, {'train': 0, 'eval': 1}[split]])
  x = rng.normal(size=(8, 8, 8)).astype(np.float32)
  return {'x': x, 'label': (x.sum((1, 2)) > 0).astype(np.int32)}


def loss(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()


STOCK_ATTENTION = parity.KnownDifference(
    ('MultiHeadDotProductAttention_0',), ('forward',),
    "flax's stock attention: nnx.MultiHeadAttention's default formula rounds otherwise than Linen's",
    substitute=parity.linen_attention)
attention_substituted = parity.model_pair(
    'attention_substituted', linen=LinenAttention(), nnx=NnxAttention, inputs=lambda b: b['x'], loss=loss,
    optimizer=optax.adam(1e-3), batch=batch, known_differences=(STOCK_ATTENTION,))
# head_dim 16 and the attention's own dropout on (NNX then computes Linen's formula itself; the
# kit gives it Linen's function all the same), its keys Linen's (model_pair's dropout='rngs').
attention_dropout_substituted = parity.model_pair(
    'attention_dropout_substituted', linen=LinenAttention(16, 0.1), nnx=lambda rngs: NnxAttention(16, 0.1, rngs=rngs),
    inputs=lambda b: b['x'], loss=loss, optimizer=optax.adam(1e-3), batch=batch, known_differences=(STOCK_ATTENTION,))
# --- end of pair ---

import dataclasses  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

from parity.pairs import adapter  # noqa: E402

pytestmark = pytest.mark.xdist_group('parity-attention_substituted')  # the pair's sides compile once



@functools.cache
def _stock() -> parity.Pair:
  """The same models undeclared, flax's stock formula on each side (one object: its runs are shared;
  not a module-level name, which the plugin would give a battery)."""
  return dataclasses.replace(attention_substituted, name='attention_stock', known_differences=())

_DECLARATION = re.compile(r'^ +(parity\.KnownDifference\(.*\))$', re.MULTILINE)


def _grads_failure() -> str:
  from parity.battery import checks

  with pytest.raises(AssertionError) as failure:
    checks.check_grads(_stock())
  return str(failure.value)


def test_undeclared_the_grads_part_fails_in_the_attention():
  message = _grads_failure()
  assert message.startswith('attention_stock: loss and gradients are not bit-identical'), message
  assert 'MultiHeadDotProductAttention_0' in message.split('\n  params/')[0], message


def test_the_hint_prints_the_declaration_that_passes():
  """The hint's declaration, evaluated, is the one the pair above declares, whose battery passes."""
  message = _grads_failure()
  assert "MultiHeadDotProductAttention_0 is flax's stock attention" in message, message
  found = _DECLARATION.findall(message)
  assert len(found) == 1, message
  hinted = eval(found[0], {'parity': parity})  # pylint: disable=eval-used
  assert (hinted.paths, hinted.passes, hinted.substitute, hinted.max_ulp) == (
      STOCK_ATTENTION.paths, STOCK_ATTENTION.passes, STOCK_ATTENTION.substitute, STOCK_ATTENTION.max_ulp)
  assert 'unless head_dim is a power of 4' not in message  # the old rule, which the measurements contradict


def test_the_kit_gives_the_stock_attention_linens_formula_in_place():
  """The NNX side's models (the state's graph included) hold Linen's formula; the model's class is
  untouched, and so is a model made outside the kit."""
  _, nnx_side = adapter.make_pair_sides(attention_substituted, None)
  assert nnx_side.substituted_modules() == {'linen_attention': {'MultiHeadDotProductAttention_0': 'substituted'}}
  assert nnx.merge(nnx_side.graphdef, nnx_side.template)[0].attention.attention_fn is parity.linen_attention
  assert NnxAttention(rngs=nnx.Rngs(0)).attention.attention_fn is nnx.dot_product_attention


def _refusal(pair) -> str:
  with pytest.raises(adapter.SideError) as failure:
    adapter.make_pair_sides(pair, None)
  return str(failure.value)


def test_a_declaration_naming_another_module_says_so():
  wrong = dataclasses.replace(STOCK_ATTENTION, paths=('Attention_0',))
  message = _refusal(dataclasses.replace(attention_substituted, name='wrong_path', known_differences=(wrong,)))
  assert 'a declared substitution does not take effect as declared' in message, message
  assert "names Attention_0, where the kit gave no module linen_attention" in message, message
  assert 'MultiHeadDotProductAttention_0 is declared by none' in message, message


def test_a_declaration_with_nothing_to_substitute_says_so():
  """The NNX model already given Linen's formula by its own code: the stand-in is given to nothing."""
  def given(rngs):
    model = NnxAttention(rngs=rngs)
    model.attention.attention_fn = parity.linen_attention
    return model

  pair = parity.model_pair('nothing_to_substitute', linen=LinenAttention(), nnx=given, inputs=lambda b: b['x'],
                           loss=loss, optimizer=optax.adam(1e-3), batch=batch, known_differences=(STOCK_ATTENTION,))
  message = _refusal(pair)
  assert 'cannot take effect: its stand-in was given to no module' in message, message
  assert 'MultiHeadDotProductAttention_0: linen_attention, given by the model' in message, message
  assert 'remove the declaration' in message, message


def test_a_side_the_kit_cannot_reach_says_so():
  """An NNX side of the user's own (no adopt_substitutes): the kit cannot give its models the stand-in."""
  class Own:
    def __init__(self, side):
      self._side = side

    def __getattr__(self, name):
      if name == 'adopt_substitutes':
        raise AttributeError(name)
      return getattr(self._side, name)

  def make_sides(mesh):
    linen, nnx_side = attention_substituted.make_sides(mesh)
    return linen, Own(nnx_side)

  message = _refusal(dataclasses.replace(attention_substituted, name='own_side', make_sides=make_sides))
  assert 'cannot take effect' in message and 'the NNX side (Own) makes its own' in message, message
  assert 'attention_fn=parity.linen_attention' in message, message
