"""Stock dropout, bit for bit: NNX dropout calls draw the keys Linen's `make_rng('dropout')` gives.

Linen's `nn.Dropout` without a key at the call draws `make_rng('dropout')`:
the key passed to `apply(..., rngs={'dropout': key})` with the module's scope
path and its per-scope call count folded in (flax `core/scope.py`, `LazyRng`).
`nnx.Dropout` called with an `nnx.Rngs` (or a stream) draws that stream's
next key, a count folded into the stream's key. The two can never give the
same masks, though both are a pure function of the step's key.

`StockNnx(dropout_keys='linen')` makes them equal with no change to either
model: while the kit traces the NNX side, each `nnx.Dropout` call given an
`nnx.Rngs` or `RngStream` *at the call* draws instead the key Linen's
`make_rng('dropout')` gives its corresponding Linen call (its path through
the pair's correspondences, its count), from the stream's key as Linen's
root key. So does the attention dropout of an `nnx.MultiHeadAttention`
given one at the call (Linen's `MultiHeadDotProductAttention` draws
`make_rng('dropout')` in its own scope). The stream still advances as it would. What stays unproven is
the key derivation itself, which is each framework's own; everything the
masks feed is compared bit for bit.

Not covered, and left as drawn: a stream the model keeps (`nnx.Dropout(rate,
rngs=rngs)` in `__init__`: its key is not the step's), a key array passed at
the call (already the same on both sides when the Linen side passes it too),
and Linen modules inside lifted transforms (`nn.scan`, `nn.vmap`), whose
RNGs Linen splits or folds differently.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator, Mapping

from flax import nnx

from parity.core import compat
from parity.compare import scopes

SCHEMES = ('nnx', 'linen')


@contextlib.contextmanager
def linen_dropout_keys(call_keys: Mapping[str, str] = {}) -> Iterator[collections.Counter]:
  """While active, every `nnx.Dropout` call given an Rngs or stream at the call draws Linen's key.

  The module's Linen path is its tag (`scopes.tag_paths` with the pair's
  renames, set by the kit before tracing); `call_keys` maps an NNX call
  (`path#n`) to the Linen call it is. Yields a counter of the calls
  substituted, by Linen call.
  """
  original = nnx.Dropout.__call__
  original_attention = nnx.MultiHeadAttention.__call__
  # Counted per Rngs object passed, as Linen counts per `apply`: one forward pass each.
  nnx_calls: collections.Counter = collections.Counter()
  linen_counts: collections.Counter = collections.Counter()
  substituted: collections.Counter = collections.Counter()
  seen: list = []  # the Rngs objects counted, kept alive so that their ids stay theirs

  def call_of(module, rngs) -> tuple[int, str] | None:
    """(the forward pass, the NNX call `path#n`) of a tagged module given an Rngs or stream at
    the call, counted; None for any other call (left as it is)."""
    path = scopes.tagged_path(module)
    if path is None or not isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
      return None
    seen.append(rngs)
    n = nnx_calls[id(rngs), path]
    nnx_calls[id(rngs), path] += 1
    return id(rngs), path if n == 0 else f'{path}#{n}'

  def linen_key(forward: int, call: str, stream):
    """The key Linen's make_rng('dropout') gives the Linen call of NNX `call`, from the stream's
    key as Linen's root; the stream advances as the draw it replaces would advance it."""
    root = stream.key[...]
    stream()
    linen_call = call_keys.get(call, call)
    linen_path = linen_call.split('#', 1)[0]
    linen_counts[forward, linen_path] += 1
    substituted[linen_call] += 1
    return compat.linen_make_rng(root, linen_path.split('/') if linen_path else [],
                                 linen_counts[forward, linen_path])

  def __call__(self, inputs, *, deterministic=None, rngs=None):
    found = call_of(self, rngs)
    off = deterministic if deterministic is not None else self.deterministic
    if found is None or off or self.rate == 0.0 or self.rate == 1.0:
      return original(self, inputs, deterministic=deterministic, rngs=rngs)
    stream = rngs[self.rng_collection] if isinstance(rngs, nnx.Rngs) else rngs
    return original(self, inputs, deterministic=deterministic, rngs=linen_key(*found, stream))

  def attention(self, *args, rngs=None, **kwargs):
    """`nnx.MultiHeadAttention` given an Rngs or stream at the call: its attention dropout draws
    (`rngs()`, where it draws at all) the key Linen's draws with make_rng('dropout') in its scope."""
    found = call_of(self, rngs) if self.dropout_rate else None
    if found is None:
      return original_attention(self, *args, rngs=rngs, **kwargs)
    stream = rngs['dropout'] if isinstance(rngs, nnx.Rngs) else rngs
    return original_attention(self, *args, rngs=lambda: linen_key(*found, stream), **kwargs)

  nnx.Dropout.__call__ = __call__
  nnx.MultiHeadAttention.__call__ = attention
  try:
    yield substituted
  finally:
    nnx.Dropout.__call__ = original
    nnx.MultiHeadAttention.__call__ = original_attention
