"""Stand-ins that make a stock NNX layer compute as its Linen counterpart: what a declared
difference's `substitute=` gives the NNX side (docs/plugin.md, "A value bound is proven and tight")."""
from __future__ import annotations

import flax.linen as nn


def linen_attention(query, key, value, bias=None, mask=None, *, is_causal=False, module=None, **kwargs):
  """flax.linen's dot-product attention as an `nnx.MultiHeadAttention(attention_fn=...)`.

  NNX's default (`jax.nn.dot_product_attention`) multiplies the logits by
  1/sqrt(head_dim) after q.k; Linen divides the query by sqrt(head_dim)
  before it. The same constant, other rounding: outputs and gradients differ
  by a few ULP unless head_dim is a power of 4. This keeps Linen's order.
  """
  del module  # NNX passes it to sow the attention weights; nothing is sown here
  if is_causal:
    raise NotImplementedError('linen_attention: is_causal is not supported; pass a causal mask instead')
  return nn.dot_product_attention(query, key, value, bias, mask, **kwargs)
