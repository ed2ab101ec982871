"""The memory part: XLA's memory analysis of both compiled train steps, per placement."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax

from parity.battery.checks.shared import _Runs, _battery_frames_hidden, _runs
from parity.compare import programs
from parity.pairs import adapter
from parity.run import compiling
from parity.run import verdicts


def check_memory(pair: adapter.Pair) -> list[str]:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  device = jax.devices()[0]
  mem, accounted = _measured_memory(runs, device)
  missing = {s: [f for f in verdicts.MEMORY_FIELDS if m.get(f) is None] for s, m in zip(('linen', 'nnx'), mem)}
  assert not any(missing.values()), (
      f'{pair.name}: XLA memory analysis not measured on {device.platform} (fields missing: {missing});'
      ' nothing compared. Leave the memory part out on a backend without it (--parity-parts)'
  )
  drift = verdicts.memory_drift(*mem)
  known = pair.program_difference()
  bound = None if known is None else known.temp_bytes(device.platform)
  if not drift:
    loose = known.loose_structure('memory', None, device.platform) if bound is not None else ''
    assert not loose, f'{pair.name}: {loose}'
    return accounted
  if verdicts.declared_memory_admits(known, *mem, device.platform):
    measured = verdicts.temporaries_moved(*mem)
    loose = known.loose_structure('memory', measured, device.platform)
    assert not loose, f'{pair.name}: {loose}'
    return accounted + [f'memory differs within the declared bound (NNX {", ".join(drift)}; at most'
            f' {bound:,} B of temporaries on {device.platform}, {", ".join(known.paths)}: {known.reason})']
  linen, nnx_ = runs.compiled('linen'), runs.compiled('nnx')
  growth = programs.loop_carry_growth(
      linen.compared_text, nnx_.compared_text, linen.argument_names, nnx_.argument_names)
  raise AssertionError(
      f'{pair.name}: XLA memory analysis of the train steps differs: NNX ' + ', '.join(drift)
      + ('' if bound is None else
         f' (beyond the declared memory difference: temporaries and peak within'
         f' {bound:,} B each on {device.platform}, everything else equal)')
      + (f'; in the programs, {growth}' if growth else '')
      + _memory_cause(pair, linen, nnx_, mem, device.platform)
      + _platform_unnamed(known, device.platform, mem)
  )


def _measured_memory(runs: _Runs, device: jax.Device) -> tuple[list[dict[str, Any]], list[str]]:
  """The two train steps' XLA memory analyses as the memory part compares them (NNX's without
  the state only NNX keeps), and the accounting lines for that state."""
  mem = [runs.compiled(s).memory(device) for s in ('linen', 'nnx')]
  if any(m.get(f) is None for m in mem for f in verdicts.MEMORY_FIELDS):
    return mem, []
  account = getattr(runs.side('nnx'), 'nnx_only_accounting', None)
  if account is None or not account()['paths']:
    return mem, []
  nnx_mem, accounted = compiling.without_nnx_only(account(), *mem, runs.compiled('linen'), runs.compiled('nnx'), device)
  return [mem[0], nnx_mem], accounted


def _temporaries_alone_moved(runs: _Runs) -> tuple[str, int] | None:
  """(platform, bytes) where the train steps' memory differs in temporaries and peak alone (the
  state's bytes equal): what a lowering that differs moves, for a declaration; None where the
  memory is equal, the state moved too, or it cannot be measured."""
  device = jax.devices()[0]
  try:
    mem, _ = _measured_memory(runs, device)
    if (any(m.get(f) is None for m in mem for f in verdicts.MEMORY_FIELDS) or not verdicts.memory_drift(*mem)
        or verdicts.memory_drift(*mem, exclude=verdicts.LAYOUT_MOVE_MEMORY)):
      return None
  except Exception:  # pylint: disable=broad-except  (a hint only)
    return None
  return device.platform, verdicts.temporaries_moved(*mem)


def _platform_unnamed(known: adapter.KnownDifference | None, platform: str,
                      mem: Sequence[Mapping[str, Any]]) -> str:
  """Where the pair's memory bound is by platform and names not this one: what adding it would take
  (the state's bytes equal, only temporaries moved), or '' (no such bound, or the state moved too)."""
  if (known is None or 'memory' not in known.passes or not isinstance(known.max_temp_bytes, tuple)
      or platform.split('@', 1)[0] not in adapter.PLATFORMS):
    return ''
  if known.temp_bytes(platform) is not None or verdicts.memory_drift(*mem, exclude=verdicts.LAYOUT_MOVE_MEMORY):
    return ''
  moved = verdicts.temporaries_moved(*mem)
  return (f'\nthe declared memory difference ({", ".join(known.paths)}) names no bound on {platform}'
          f' (max_temp_bytes={adapter.temp_bytes_text(known.max_temp_bytes)}); if this is the same cause here, add the'
          f' bytes measured: max_temp_bytes={adapter.temp_bytes_text(known.max_temp_bytes, (platform, moved))}')


def _memory_cause(pair: adapter.Pair, linen: compiling.CompiledStep, nnx_: compiling.CompiledStep,
                  mem: Sequence[Mapping[str, Any]], platform: str) -> str:
  """The likely cause of a memory difference, from the program comparison (the program part's
  finding): XLA's memory follows the program, so a program that differs is named with where it
  parts; a declared program difference that holds, with the memory declaration it lacks; the
  same program, as such."""
  try:
    d = compiling.program_diff_of(linen, nnx_)
  except Exception as e:  # pylint: disable=broad-except  (a hint only: the failure stands without it)
    return f'\nlikely cause: not found (the programs could not be compared: {type(e).__name__}: {e})'
  if d.identical:
    said = ('\nlikely cause: none in the programs, which are identical (the program part passes): XLA lays'
            ' out the same computation otherwise' + (f' ({d.loop_order})' if d.loop_order else ''))
    if verdicts.memory_drift(*mem, exclude=verdicts.LAYOUT_MOVE_MEMORY):
      return said  # the state's bytes moved too: not a layout of temporaries alone
    moved = verdicts.temporaries_moved(*mem)
    return (said + '. Where that layout is flax\'s own and neither model can change it (nn.RNN\'s and'
            " nnx.RNN's loops carry a cell's parameters in another order), declare it with the bytes"
            f" measured: KnownDifference((<the loop's module>,), ('memory',), reason=...,"
            f' max_temp_bytes={{{platform!r}: {moved}}})')
  known = pair.program_difference()
  if known is not None and 'program' in known.passes and 'memory' not in known.passes:
    outside = compiling.program_diff_of(linen, nnx_, tuple(known.paths))
    state_equal = not verdicts.memory_drift(*mem, exclude=verdicts.LAYOUT_MOVE_MEMORY)
    if known.admits_program(d, outside) and state_equal:
      moved = verdicts.temporaries_moved(*mem)
      return (f'\nlikely cause: the declared program difference ({", ".join(known.paths)}: {known.reason}), which'
              ' holds (the programs are identical outside those modules): a lowering that differs places its'
              " temporaries otherwise. If so, declare 'memory' beside 'program' in it, with the bytes measured:"
              f" passes={tuple(known.passes) + ('memory',)!r}, max_temp_bytes={moved} (or, where the figure"
              f" is this backend's alone, max_temp_bytes={{{platform!r}: {moved}}})")
  return ('\nlikely cause: the train steps\' programs differ, and XLA\'s memory follows the program. The'
          f' program part\'s finding: {d.summary(loop_growth=False)}'
          + ''.join(f'\n  {line}' for line in d.parting_lines())
          + '\n(the program part names what differs, with the declaration to write where flax\'s stock layers'
          ' explain it' + ('' if verdicts.memory_drift(*mem, exclude=verdicts.LAYOUT_MOVE_MEMORY) else
                           "; where it offers one, that declaration takes the memory too, the state's bytes"
                           f" being equal: passes=('program', 'memory'), max_temp_bytes={{{platform!r}:"
                           f' {verdicts.temporaries_moved(*mem)}}}') + ')')
