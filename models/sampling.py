"""Sampling decoded tokens, shared by both sides' decoding (models/linen/decode.py and
models/nnx/decode.py, models/linen/lm.py and models/nnx/lm.py).

The kit's token loop (`parity.draw_tokens`, parity/pairs/decoding.py): the
same function of (logits, key, step, temperature) on both sides, so sampled
tokens can be equal; `draw_tokens` is the token loop each side runs around
its own model.
"""
from __future__ import annotations

from parity.pairs.decoding import draw_tokens, sample  # noqa: F401  (re-exported: the models' names)
from parity.pairs.decoding import sampling_key as step_key  # noqa: F401  (the sampling key of a step)
