"""The localize part: the divergence localizer finds nothing on a bitwise pair."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from parity.battery.checks.shared import _battery_frames_hidden, _runs
from parity.compare import localize
from parity.pairs import adapter


def check_localize(pair: adapter.Pair) -> list[str]:
  """The localizer finds nothing beyond the pair's declared differences.

  A forward divergence must start in a module declared for the 'forward'
  pass, within its ULP bound; a backward divergence may only touch
  parameters declared for 'grads'. NNX module calls with no Linen call to
  compare with (and no Linen call without an NNX one) are a note where
  every compared output and gradient is bitwise, and named, with what to
  write, where anything differs.
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  result = runs.localization()
  # Not vacuous: every module call and parameter gradient is compared. NNX calls with no
  # Linen call to compare with (a module Linen computes inline) are not a difference: a note
  # where every compared value is bitwise, named where something differs (they may hold it).
  extra = [] if result.only_linen else list(result.only_nnx)
  problems = list(dataclasses.replace(result, only_nnx=[]).unmatched if extra else result.unmatched)
  seen = []
  if result.forward is not None:
    known = pair.known(result.forward, 'forward')
    if known is None:
      problems.append(f'forward divergence in undeclared module {result.forward}')
    elif result.forward_ulp is None:
      problems.append(f'{result.forward}: {result.details[result.forward_call]} (a declared bound in ULP'
                      ' covers float values of one dtype and shape only)')
    elif result.forward_ulp > known.max_ulp:
      problems.append(f'{result.forward}: {result.forward_ulp} ULP exceeds the declared {known.max_ulp}')
    else:
      seen.append(f'{result.forward}: forward, {result.forward_ulp} ULP'
                  f' (declared bound {known.max_ulp}: {known.reason})')
  for known in pair.known_differences:
    if 'forward' in known.value_passes:
      forward = result.forward_ulp if result.forward is not None and known.covers(result.forward, 'forward') else 0
      problems += known.refusals('forward', forward or 0)
  for module, params in result.backward:
    undeclared = [p for p in params if pair.known(p, 'grads') is None]
    if undeclared:
      problems.append(f'backward divergence inside {module}: {undeclared}')
  calls = _nnx_only_calls(runs.side('nnx'), extra)
  if extra and (problems or not result.clean):
    first = calls[0].split(' (Linen ')[0]
    problems.append(
        f'NNX module calls with no Linen counterpart, not compared: {", ".join(calls)}; the difference may'
        ' start in one of them (the localizer names the first compared module it reaches). Where one is'
        ' a Linen module under another name, pair the two with a Renames entry:'
        f" StockNnx(renames=parity.Renames((('<Linen path>', '{first}'),))) (`parity renames --pair"
        ' FILE.py:NAME` prints the correspondences inferred)')
  assert not problems, (
      f'{pair.name}: the localizer finds undeclared differences: {problems}\n  '
      + '\n  '.join(result.lines())
  )
  if extra:
    seen.append(f'NNX module calls with no Linen counterpart, not compared (a note: every compared output'
                f' and gradient is bitwise): {", ".join(calls)}')
  return seen + result.lines()


def _nnx_only_calls(nnx_side: adapter.Side, keys: Sequence[str]) -> list[str]:
  """NNX calls the localizer keys by Linen path, named by their NNX attribute paths (`blocks/0/act
  (Linen DecoderBlock_0/act)`, the Linen name where the side's renames give another)."""
  renames = getattr(nnx_side, 'renames', None)
  shown = []
  for key in keys:
    path, sep, repeat = key.partition('#')
    own = renames.to_nnx(path) if renames is not None and path != localize.ROOT else path
    shown.append(f'{own}{sep}{repeat}' + (f' (Linen {key})' if own != path else ''))
  return shown
