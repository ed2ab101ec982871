"""The localizer on a decode: the first module call that differs, and in which model call.

A side's decode function runs once more, eagerly, its module calls recorded
one record per model call (the prefill's, then one per token fed:
parity/compare/model_calls.py); the first model call with a differing module
output is named with the module.

Model call r of R maps to the decode's steps as the decode part counts them
(`Side.decode`): the last `steps - 1` model calls feed tokens 0..steps-2 and
give the logits of steps 1..steps-1; the calls before them are the prefill,
whose last gives step 0's logits.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from parity.compare import localize
from parity.compare import model_calls as per_call
from parity.pairs import adapter


@dataclasses.dataclass
class DecodeLocalization:
  """Where a decode first differs: a module and the model call (and decode step) it ran in."""

  model_calls: tuple[int, int]  # model calls recorded (Linen, NNX)
  steps: int
  call: int | None = None  # the first model call with a difference (None: every call agrees)
  found: localize.Localization | None = None
  compared_calls: int = 0

  def step(self) -> str:
    """Model call `call` as the decode part counts steps."""
    prefill = self.model_calls[0] - (self.steps - 1)
    if self.call >= prefill:
      return f'decode step {self.call - prefill + 1} of {self.steps} (it feeds token {self.call - prefill})'
    last = ', which gives step 0\'s logits' if self.call == prefill - 1 else ''
    return f'the prefill (model call {self.call} of its {prefill}{last})'

  def lines(self) -> list[str]:
    if self.model_calls[0] != self.model_calls[1]:
      return [f'decode localizer: the sides call their models {self.model_calls[0]} (Linen) and'
              f' {self.model_calls[1]} (NNX) times while decoding; compared the first'
              f' {min(self.model_calls)}' + ('' if self.found is None else f': {self._where()}')]
    if self.found is None:
      return [f'decode localizer: all {self.model_calls[0]} model calls of the decode ({self.compared_calls}'
              ' module calls) agree bit for bit when run eagerly: the difference arises outside the'
              ' modules (sampling, the cache\'s handling between calls) or only when compiled']
    return [f'decode localizer: {self._where()}']

  def _where(self) -> str:
    detail = self.found.details.get(self.found.forward_call, '')
    return (f'first differs {per_call.where(self.found)}, in model call {self.call} of'
            f' {self.model_calls[0]}: {self.step()} ({detail})')

  def first(self) -> dict[str, Any] | None:
    """`{path, model_call, step}` of the first difference (None: none found)."""
    if self.found is None:
      return None
    prefill = self.model_calls[0] - (self.steps - 1)
    return {'path': self.found.forward, 'model_call': self.call,
            'step': self.call - prefill + 1 if self.call >= prefill else None}


def localize_decode(linen: list[adapter.Probe], nnx_calls: list[adapter.Probe], steps: int) -> DecodeLocalization:
  """The first model call of the decode in which a recorded module output differs, and that module."""
  call, found, compared = per_call.first_difference(linen, nnx_calls)
  return DecodeLocalization(model_calls=(len(linen), len(nnx_calls)), steps=steps, call=call, found=found,
                            compared_calls=compared)
