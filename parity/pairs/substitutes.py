"""Stand-ins that make a stock NNX layer compute as its Linen counterpart: what a declared
difference's `substitute=` gives the NNX side (docs/howto-differences.md, "Stock attention")."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx


def linen_attention(query, key, value, bias=None, mask=None, *, is_causal=False, module=None, **kwargs):
  """flax.linen's dot-product attention as an `nnx.MultiHeadAttention(attention_fn=...)`.

  Linen divides the query by sqrt(head_dim) before q.k. NNX's default, at
  `dropout_rate` 0, calls `jax.nn.dot_product_attention`, which multiplies the
  logits by 1/sqrt(head_dim) after q.k and lays its contractions out otherwise
  (with a dropout rate above 0 it computes Linen's formula itself). Outputs and
  gradients can differ at any head_dim: measured on one attention (CPU, jax
  0.10.2), forward 47 to 451 ULP and parameter gradients up to 13,644 ULP at
  head_dim 1, 2, 8 and 32, nothing at 4, 16 and 64, where both scalings are
  exact and only the order of the sums can differ, as it did at head_dim 1 here
  and at head_dim 16 on a user's setup (docs/howto-differences.md, "Stock attention";
  benchmarks/attention_rounding.py). This keeps Linen's order. Declared as a
  `KnownDifference`'s `substitute=`, the kit gives it to the NNX model's stock
  attentions itself, in every part (`IN_PLACE`).
  """
  del module  # NNX passes it to sow the attention weights; nothing is sown here
  if is_causal:
    raise NotImplementedError('linen_attention: is_causal is not supported; pass a causal mask instead')
  return nn.dot_product_attention(query, key, value, bias, mask, **kwargs)


# Stand-ins the kit applies itself, in place, when a declared difference names one as its
# `substitute=` (a KnownDifference): the stock NNX class it is for, the attribute it replaces,
# and that attribute's stock value. The kit gives each such instance of the model every NNX
# side makes the stand-in, in every part, with no change to the model's code.
IN_PLACE = {linen_attention: (nnx.MultiHeadAttention, 'attention_fn', nnx.dot_product_attention)}


def in_place(substitute: Any) -> bool:
  """Whether `substitute` (a KnownDifference's) is a stand-in the kit applies in place."""
  return any(substitute is fn for fn in IN_PLACE)


def instances(graph: Any, substitute: Any) -> dict[str, str]:
  """The instances of `substitute`'s stock class in `graph` (a model, or the tuple an NNX side's
  `create` returns), by graph path ('0/blocks/0/attention'), each with what its attribute holds:
  'stock' (the stock value), or the name of the function it holds (the stand-in's, where the
  model gives it itself)."""
  cls, attribute, stock = IN_PLACE[substitute]
  found = {}
  for path, node in nnx.iter_graph(graph):
    if isinstance(node, cls):
      value = getattr(node, attribute, None)
      found['/'.join(str(k) for k in path)] = 'stock' if value is stock else getattr(value, '__name__', repr(value))
  return found


def substitute_in_place(graph: Any, substitute: Any) -> list[str]:
  """Gives every stock instance in `graph` the stand-in (`attention_fn=linen_attention` on each
  `nnx.MultiHeadAttention` left with flax's default); returns their graph paths."""
  cls, attribute, stock = IN_PLACE[substitute]
  done = []
  for path, node in nnx.iter_graph(graph):  # each node once, however often it is referenced
    if isinstance(node, cls) and getattr(node, attribute, None) is stock:
      setattr(node, attribute, substitute)
      done.append('/'.join(str(k) for k in path))
  return done
