"""The program part: both train steps' canonical programs, and a declaration to suggest."""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
from flax import nnx

import parity.battery.checks.memory as memory_part
from parity.battery.checks.shared import _Runs, _battery_frames_hidden, _runs
from parity.compare import programs
from parity.core import compat
from parity.pairs import adapter
from parity.pairs import correspond
from parity.pairs import substitutes
from parity.run import compiling


def check_program(pair: adapter.Pair) -> list[str]:
  """Canonical programs identical, or within the pair's declared program difference."""
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  linen, nnx_ = runs.compiled('linen'), runs.compiled('nnx')
  d = compiling.program_diff_of(linen, nnx_)
  known = pair.program_difference()
  if known is not None and 'program' not in known.passes:  # a memory difference alone
    known = None
  if d.identical:
    loose = '' if known is None else known.loose_structure('program', None)
    assert not loose, f'{pair.name}: {loose}'
    return []
  # Confined to the declared modules: with their operations left out, the rest is identical.
  outside = None if known is None else compiling.program_diff_of(linen, nnx_, tuple(known.paths))
  if known is not None and outside is not None and outside.identical:
    # Confined to the declared modules: a constant or an operation that differs there is named as
    # what it is before the bound is weighed (a bug moves the line count either way).
    changed = _numbers_part(pair, runs, d).value_changes
    if changed:  # raised, not asserted: pytest would rewrite the lines of an assert's message
      within = ('within the declared bound' if d.changed_lines <= known.max_changed_lines else
                f'beyond the declared bound ({known.max_changed_lines} lines)')
      raise AssertionError(
          f'{pair.name}: the programs differ {within} ({d.changed_lines} canonical lines,'
          f' {", ".join(known.paths)}: {known.reason}), and inside those modules a constant or an operation'
          ' differs, which a program declaration never covers: it declares a lowering with the same numbers'
          ' (a value reshaped otherwise), not other numbers. Where they part:\n  '
          + '\n  '.join(changed[:10]) + (f'\n  ... ({len(changed) - 10} more)' if len(changed) > 10 else '')
          + '\nA bug in those modules; or, where their numbers differ by design, a value bound on them with its'
          ' substitution (docs/howto-differences.md, "A value bound is proven and tight")')
  if known is not None and known.admits_program(d, outside):
    loose = known.loose_structure('program', d.changed_lines)
    assert not loose, f'{pair.name}: {loose}'
    return [f'{d.changed_lines} canonical lines (declared bound {known.max_changed_lines},'
            f' {", ".join(known.paths)}: {known.reason}); identical outside those modules']
  if known is None or d.changed_lines > known.max_changed_lines:
    where = ''
    if outside is not None:
      where = ('; identical outside those modules: the declared modules changed more than the bound'
               if outside.identical else f'; outside those modules too: {outside.summary(loop_growth=False)}')
    raise AssertionError(
        f'{pair.name}: {d.summary()}'
        + (_suggested_declaration(pair, runs, d) if known is None else
           f' (declared bound {known.max_changed_lines} lines in {", ".join(known.paths)}:'
           f' {known.reason}{where})'
           + ('' if outside.identical else _suggested_declaration(pair, runs, d, known)))
        + ''.join(f'\n{line}' for line in d.parting_lines()) + f'\n{d.diff}'
    )
  raise AssertionError(
      f'{pair.name}: the programs differ outside the modules declared ({", ".join(known.paths)}):'
      f' {outside.summary()} (their operations left out; an NNX side names its module calls'
      f' for this, parity/compare/scopes.py)' + _suggested_declaration(pair, runs, d, known)
      + ''.join(f'\n{line}' for line in outside.parting_lines()) + f'\n{outside.diff}'
  )


def _numbers_part(pair: adapter.Pair, runs: _Runs, d: programs.ProgramDiff,
                  left_out: tuple[str, ...] = ()) -> programs.ProgramDiff:
  """The program diff `d`, with the operations of `left_out` and of the modules whose numbers are
  proven to differ left out (a 'forward' value bound with its substitution, the only kind of
  declaration that lets a constant or an operation differ): its `value_changes` are where the
  numbers part elsewhere."""
  proven = tuple(p for known in pair.known_differences if known.substitute is not None
                 and not substitutes.in_place(known.substitute)  # applied in place: Linen's numbers
                 and 'forward' in known.value_passes for p in known.paths)
  modules = tuple(dict.fromkeys(left_out + proven))
  return d if not modules else compiling.program_diff_of(runs.compiled('linen'), runs.compiled('nnx'), modules)


# flax's stock layers whose Linen and NNX versions lower otherwise (the same numbers): the
# program part tries them as a declaration when a pair's programs differ and it declares none.
STOCK_LOWERINGS = ('LayerNorm', 'BatchNorm', 'GroupNorm', 'RMSNorm', 'MultiHeadDotProductAttention',
                   'SelfAttention')


def _stock_types() -> dict[str, tuple[type, type]]:
  """flax's stock layers of STOCK_LOWERINGS by their Linen class's name: (that Linen class, its
  NNX counterpart). A project's own class of the same name is none of them."""
  types = {'LayerNorm': (nn.LayerNorm, nnx.LayerNorm), 'BatchNorm': (nn.BatchNorm, nnx.BatchNorm),
           'GroupNorm': (nn.GroupNorm, nnx.GroupNorm), 'RMSNorm': (nn.RMSNorm, nnx.RMSNorm),
           'MultiHeadDotProductAttention': (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention),
           'SelfAttention': (getattr(nn, 'SelfAttention', None), nnx.MultiHeadAttention)}
  return {name: classes for name, classes in types.items() if name in STOCK_LOWERINGS and classes[0] is not None}


def _nnx_modules(runs: _Runs, linen_paths: Sequence[str]) -> dict[str, Any]:
  """The NNX side's modules at `linen_paths` (Linen paths, through its renames), in a fresh model;
  a path whose module is not found there is left out (so is every one, for a side of your own)."""
  side = runs.side('nnx')
  if not hasattr(side, 'create') or not hasattr(side, 'renames'):
    return {}
  try:
    with compat.eager_sharding_off():
      model = side.create(runs.pair.seed)[0]
  except Exception:  # pylint: disable=broad-except  (a hint only)
    return {}
  found = {}
  for path in linen_paths:
    node = model
    try:
      for name in filter(None, side.renames.to_nnx(path).split('/')):
        node = node[int(name)] if name.isdigit() else getattr(node, name)
    except Exception:  # pylint: disable=broad-except
      continue
    found[path] = node
  return found


def _suggested_declaration(pair: adapter.Pair, runs: _Runs, d: programs.ProgramDiff,
                           declared: adapter.KnownDifference | None = None) -> str:
  """Where the programs are identical once the fewest kinds of flax's stock layers that lower
  otherwise are left out (beside the modules `declared` already): the declaration to write, its
  bound measured, and the lines that differ there ('' where none does).

  A module counts as flax's stock layer only where it is flax's class itself on both sides (a
  project's own `RMSNorm` is not flax's). Offered only where the lines that differ there reshape
  the same values otherwise (the same numbers); where a constant or an operation differs, it
  says so and offers nothing.
  """
  linen_side = runs.side('linen')
  if not hasattr(linen_side, 'loss'):
    return ''
  try:
    calls = correspond.linen_calls(linen_side, linen_side.init(pair.seed), pair.batch(0, 'train'),
                                   runs.dropout_base())
  except Exception:  # pylint: disable=broad-except  (a hint only: the failure stands without it)
    return ''
  stock = _stock_types()
  base = tuple(declared.paths) if declared is not None else ()
  candidates: dict[str, list[str]] = {}
  for call in calls:
    if (call.cls in stock and call.module_type is stock[call.cls][0] and call.key == call.path
        and call.path not in base and call.path not in candidates.get(call.cls, [])):
      candidates.setdefault(call.cls, []).append(call.path)
  found = _nnx_modules(runs, [p for paths in candidates.values() for p in paths])
  by_class = {cls: [p for p in paths if p in found and type(found[p]) is stock[cls][1]]
              for cls, paths in candidates.items()}
  by_class = {cls: paths for cls, paths in by_class.items() if paths}
  linen, nnx_ = runs.compiled('linen'), runs.compiled('nnx')

  def identical_without(classes) -> bool:
    modules = tuple(p for c in classes for p in by_class[c])
    return bool(modules) and compiling.program_diff_of(linen, nnx_, base + modules).identical

  kept = sorted(by_class)
  if not identical_without(kept):
    return ''
  for cls in list(kept):  # the fewest kinds that still explain every difference
    if len(kept) > 1 and identical_without([c for c in kept if c != cls]):
      kept.remove(cls)
  modules = [p for c in kept for p in by_class[c]]
  where = (f'{"the modules declared and " if base else ""}flax\'s stock {", ".join(kept)} ({len(modules)}'
           f' module{"s" if len(modules) != 1 else ""})')
  inside = _numbers_part(pair, runs, d, base)  # what differs, all inside those modules
  if inside.value_changes or not inside.reshapes:
    shown = inside.value_changes[:6] + ([f'... ({len(inside.value_changes) - 6} more)']
                                        if len(inside.value_changes) > 6 else [])
    what = ('a constant or an operation differs, which no lowering of the same numbers explains'
            if inside.value_changes else 'no line that differs reads as a reshape of the same values')
    return (f'\nthe programs are identical outside {where}, but there {what}: no declaration to offer (a bug'
            ' in those modules; or numbers that differ by design, declared as a value bound with its'
            ' substitution)' + ''.join(f'\n  {line}' for line in shown))
  shown = inside.reshapes[:6] + ([f'... ({len(inside.reshapes) - 6} more)'] if len(inside.reshapes) > 6 else [])
  kinds = f'flax\'s stock {", ".join(kept)} {"lowers" if len(kept) == 1 else "lower"} differently in Linen and NNX'
  if declared is None:
    moved = memory_part._temporaries_alone_moved(runs)
    passes, temp = (('program',), '') if moved is None else (
        ('program', 'memory'), f', max_temp_bytes={{{moved[0]!r}: {moved[1]}}}')
    declaration = (f'parity.KnownDifference({tuple(modules)!r}, {passes!r}, max_changed_lines={d.changed_lines}'
                   f'{temp}, reason="{kinds} (same numbers)")')
    advice = ('if that is the only difference, declare it (and check the memory part)' if moved is None else
              'if that is the only difference, declare it, with the temporaries the memory part measured'
              f' this lowering to move ({moved[1]:,} B on {moved[0]}, the state\'s bytes equal)')
  else:
    temp = f', max_temp_bytes={adapter.temp_bytes_text(declared.max_temp_bytes)}' if declared.max_temp_bytes else ''
    reason = f'{declared.reason}; {kinds} (same numbers)'
    declaration = (f'parity.KnownDifference({base + tuple(modules)!r}, {tuple(declared.passes)!r},'
                   f' max_changed_lines={d.changed_lines}{temp}, reason={reason!r})')
    advice = ('if that is the only difference, declare them with the modules declared, in place of the'
              ' pair\'s program declaration (the program part reads one; and check the memory part)')
  return (f'\nthe programs are identical outside {where}, whose Linen and NNX versions (flax\'s own classes'
          ' on both sides) lower otherwise;'
          ' the lines that differ there reshape the same values otherwise (the same numbers):'
          + ''.join(f'\n  {line}' for line in shown) + f'\n{advice}:\n  {declaration}')
