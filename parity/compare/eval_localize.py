"""The localizer on an eval step: the first module call that differs in eval mode.

The train-mode localizer (parity/compare/localize/) cannot see what only
eval mode computes: a dropout left on, a scaling applied at inference, a
norm reading batch statistics. Here each side's eval step runs once more,
eagerly, from the state the eval part compared, its module calls recorded
one record per model call (parity/compare/model_calls.py); the first
module whose output differs is named, with the model call it ran in where
the step calls its model more than once.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from parity.compare import localize
from parity.compare import model_calls as per_call
from parity.pairs import adapter


@dataclasses.dataclass
class EvalLocalization:
  """Where an eval step first differs: a module, and the model call it ran in."""

  model_calls: tuple[int, int]  # model calls recorded (Linen, NNX)
  call: int | None = None  # the first model call with a difference (None: every call agrees)
  found: localize.Localization | None = None
  compared_calls: int = 0
  unrecorded: tuple[str, ...] = ()  # modules called inside a transformed body run traced (not recorded)

  def lines(self) -> list[str]:
    linen, nnx_calls = self.model_calls
    if not linen or not nnx_calls:
      return [f'eval localizer: no module call recorded in the eval step ({linen} model calls in Linen,'
              f' {nnx_calls} in NNX): nothing localized']
    if linen != nnx_calls:
      return [f'eval localizer: the sides call their models {linen} (Linen) and {nnx_calls} (NNX) times in'
              f' one eval step; compared the first {min(self.model_calls)}'
              + ('' if self.found is None else f': {self._where()}')]
    if self.found is None:
      hidden = '' if not self.unrecorded else (
          f'; not recorded: module calls inside a transformed body, {localize._shown(list(self.unrecorded))},'
          ' where it may arise too')
      return [f'eval localizer: all {self.compared_calls} module calls of the eval step agree bit for bit'
              ' when run eagerly: the difference arises outside the modules (the step\'s loss or metrics'
              f' on the outputs) or only when compiled{hidden}']
    return [f'eval localizer: {self._where()}']

  def _where(self) -> str:
    found = self.found
    detail = found.details.get(found.forward_call, '')
    call = f', in model call {self.call} of {self.model_calls[0]}' if self.model_calls[0] > 1 else ''
    return f'first differs {per_call.where(found)}{call}, run eagerly in eval mode ({detail}){found.unchanged_note()}'

  def first(self) -> dict[str, Any] | None:
    """`{path, model_call, unchanged}` of the first difference (None: none found); `unchanged`,
    the side whose call returned its input unchanged (`Localization.forward_unchanged`)."""
    if self.found is None:
      return None
    return {'path': self.found.forward, 'model_call': self.call, 'unchanged': self.found.forward_unchanged}


def localize_eval(linen: list[adapter.Probe], nnx_calls: list[adapter.Probe]) -> EvalLocalization:
  """The first model call of the eval step in which a recorded module output differs, and that module."""
  call, found, compared = per_call.first_difference(linen, nnx_calls)
  unrecorded = tuple(dict.fromkeys(u for probe in (*linen, *nnx_calls) for u in probe.unrecorded))
  return EvalLocalization(model_calls=(len(linen), len(nnx_calls)), call=call, found=found,
                          compared_calls=compared, unrecorded=unrecorded)
