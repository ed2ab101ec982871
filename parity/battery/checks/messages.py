"""Lines several parts print: why a dropout, an RNN loop or a stock attention computes otherwise."""
from __future__ import annotations

from typing import Any, Sequence


def _is_dropout(module: str) -> bool:
  """Whether a module's path names a dropout (`Dropout_0`, `attention_dropout`)."""
  return 'dropout' in module.rsplit('/', 1)[-1].lower()


def rnn_loop_line(named: str, where: str, path: str, broadcast: Any, scheme: Any) -> str:
  """Why a dropout held in the cell of an `nnx.RNN` (at `path`, its `broadcast_rngs` and
  `parity.pairs.dropout._loop_scheme`) differs, and what to give that RNN."""
  filt = broadcast.__name__ if isinstance(broadcast, type) else repr(broadcast)
  head = (f"{named} draws from an RNG stream the NNX model keeps ({where}), in the cell of the nnx.RNN"
          f" at {path or 'the root'} (broadcast_rngs={filt})")
  docs = ' (docs/reference-dropout.md, "Recurrent dropout")'
  if scheme is None:
    return (head + ", whose filter takes the cell's RNG state in a way the kit does not map onto"
            " Linen's (other RNG state of the cell, or streams that fare otherwise than each other):"
            " the kit leaves the loop as nnx.RNN draws it, its streams drawing their own keys, not"
            " Linen's. Give the NNX RNN broadcast_rngs=None for a mask per step (Linen's nn.RNN(...,"
            " split_rngs={'dropout': True})), or broadcast_rngs='dropout' for one mask for every step"
            " (split_rngs={'dropout': False}), as the Linen side draws" + docs)
  if scheme[0]:
    return (head + ": it broadcasts the stream's count, so its steps draw one mask for every step,"
            " which the kit draws as Linen's split_rngs={'dropout': False} does. Where the Linen"
            " side's RNN draws a mask per step (split_rngs={'dropout': True}), the NNX RNN needs"
            " broadcast_rngs=None" + docs)
  return (head + ": its loop carries the stream's count, so its steps draw a mask each, which the"
          " kit draws as Linen's split_rngs={'dropout': True} does. Where the Linen side's RNN"
          " draws one mask for every step (split_rngs={'dropout': False}), the NNX RNN needs"
          " broadcast_rngs='dropout' (the stream whole)" + docs)


def stock_attention_lines(module: str, modules: Sequence[str] = ()) -> list[str]:
  """Why flax's stock attention differs, and the route that passes with no change to the model:
  the in-place substitution, declared for `modules` (every stock attention of the NNX model,
  by Linen path; `module` alone where they are not known)."""
  modules = tuple(modules) or (module,)
  declaration = (f'parity.KnownDifference({modules!r}, (\'forward\',), "flax\'s stock attention:'
                 f' nnx.MultiHeadAttention\'s default formula rounds otherwise than Linen\'s",'
                 ' substitute=parity.linen_attention)')
  return [f"{module} is flax's stock attention. With dropout_rate 0, nnx.MultiHeadAttention's default calls"
          ' jax.nn.dot_product_attention, which multiplies the logits by 1/sqrt(head_dim) after q.k and lays'
          " its contractions out otherwise; Linen's divides the query by sqrt(head_dim) before q.k. Its"
          ' outputs and gradients can differ at any head_dim, a power of 4 too (docs/howto-differences.md,'
          ' "Stock attention", has the figures); with a dropout rate above 0 NNX computes Linen\'s formula itself.'
          " To keep the model as it is, declare the difference with the kit's stand-in as its substitute:"
          " the kit then gives every stock nnx.MultiHeadAttention of the NNX model Linen's formula in every"
          ' part, and compares them bit for bit:',
          f'  {declaration}',
          '(the declaration names every one of them; or give the NNX modules attention_fn=parity.linen_attention'
          ' in the model yourself, and declare nothing)']
