"""The substitution part: a declared difference's stand-in makes the numbers bitwise."""
from __future__ import annotations

import dataclasses

from parity.battery.checks.decode import check_decode
from parity.battery.checks.evaluation import check_eval
from parity.battery.checks.grads import check_grads
from parity.battery.checks.localize import check_localize
from parity.battery.checks.shared import _battery_frames_hidden, _runs
from parity.battery.checks.train import check_train
from parity.pairs import adapter
from parity.pairs import substitutes


def check_substitution(pair: adapter.Pair) -> list[str]:
  """Each declared value bound, proven confined: with its `substitute` sides (the difference
  removed), the pair's value parts (grads, train from Linen, eval, localize) are bit for bit,
  with no value bound declared; so the declared modules are the only source. A stand-in the
  kit applies in place (parity.linen_attention) is in every part already: the line names the
  modules given it."""
  __tracebackhide__ = _battery_frames_hidden
  lines = []
  for known in pair.known_differences:
    if not known.value_passes:
      continue
    if substitutes.in_place(known.substitute):
      lines += _in_place_lines(pair, known)
      continue
    if known.substitute is None:
      unproven = [r for r in known.refusals(known.value_passes[0], 0) if 'no substitution' in r]
      raise AssertionError(f'{pair.name}: ' + unproven[0])
    # In-place stand-ins stay: they are no bound, and every part runs with them.
    rest = tuple(d for d in pair.known_differences if not d.value_passes or substitutes.in_place(d.substitute))
    substituted = dataclasses.replace(pair, name=f'{pair.name} (substituted: {", ".join(known.paths)})',
                                      make_sides=known.substitute, known_differences=rest, parts=None)
    try:
      check_grads(substituted)
      check_train(substituted, 'linen')
      check_eval(substituted)
      check_localize(substituted)
      if substituted.decode is not None:
        from parity.battery.parts import ONE_DEVICE

        check_decode(substituted, ONE_DEVICE)
    except AssertionError as e:
      raise AssertionError(
          f'{pair.name}: with the substitution of {", ".join(known.paths)} ({known.reason}) the pair is'
          f' still not bit-identical, so the declared modules are not the only difference:\n{e}') from None
    lines.append(f'{", ".join(known.paths)}: with the substitution, grads, train, eval, the localizer'
                 f'{" and decoding" if substituted.decode is not None else ""} are bit for bit: the declared'
                 ' modules are the only source')
  return lines


def _in_place_lines(pair: adapter.Pair, known: adapter.KnownDifference) -> list[str]:
  """What an in-place substitution did: the modules the kit gave its stand-in (make_pair_sides
  has checked they are exactly the declared ones), under which every part compares bit for bit."""
  side = _runs(pair).side('nnx')
  given = [p for p, state in side.substituted_modules()[known.substitute.__name__].items() if state == 'substituted']
  cls, attribute, _ = substitutes.IN_PLACE[known.substitute]
  assert given, f'{pair.name}: {known.describe()} was given to no module'  # make_pair_sides refuses it first
  return [f'{", ".join(given)}: {cls.__name__} given {attribute}=parity.{known.substitute.__name__} by the kit in'
          f' every part (no model edited: {known.reason}); their values are compared bit for bit']
