"""Two canonical programs compared: where they part, and what changed (`ProgramDiff`, `diff`)."""
from __future__ import annotations

import dataclasses
import difflib
import re

import numpy as np

from parity.compare.programs.canonical import _short_names, canonicalize
from parity.compare.programs.loops import AllowedDifference, _MAIN_SIGNATURE, loop_carry_growth, loop_order_difference
from parity.compare.programs.text import _VALUE_TOKEN


@dataclasses.dataclass
class ProgramDiff:
  identical: bool
  # 1-based line in the canonical Linen program; None when identical.
  first_difference: int | None
  linen_lines: int
  nnx_lines: int
  changed_lines: int  # lines removed plus lines added
  diff: str  # a short unified diff of the canonical programs, '' when identical
  first_linen: str = ''  # the first differing canonical line, each side
  first_nnx: str = ''
  allowed: list[str] = dataclasses.field(default_factory=list)  # names of ALLOWED entries applied
  # Where the programs part (`_parting`): each side's first operations (up to 3) of
  # values only it computes, from operands both compute; [] when identical.
  parting_linen: list[str] = dataclasses.field(default_factory=list)
  parting_nnx: list[str] = dataclasses.field(default_factory=list)
  # A note, not a difference: where the canonical programs are identical, a loop carrying the
  # same values in another order (`loop_order_difference`). The same program; XLA schedules
  # from the carried order, and where that changes memory, the memory part measures it.
  loop_order: str = ''
  # Arguments (by name) of one program only: state one side has and the other has not,
  # or an input one side never reads (jit drops it).
  arguments_only_linen: list[str] = dataclasses.field(default_factory=list)
  arguments_only_nnx: list[str] = dataclasses.field(default_factory=list)
  # Where they differ: a loop carrying its counterpart's values and more (`loop_carry_growth`).
  loop_growth: str = ''
  # Of every operation where the programs part (`_parting`, all of them, `Linen: ...` / `NNX: ...`):
  # those that change values (`value_changes`: a constant, an operation other than a reshape
  # of a value the other side reshapes alike), and the reshapes both sides make of one value
  # to one type, otherwise spelt (`reshapes`: the same numbers). [] when identical.
  value_changes: list[str] = dataclasses.field(default_factory=list)
  reshapes: list[str] = dataclasses.field(default_factory=list)

  def summary(self, loop_growth: bool = True) -> str:
    """One line; `loop_growth=False` leaves out `loop_growth`, for a second summary beside one that has it."""
    if self.identical:
      except_ = f' except: {", ".join(self.allowed)}' if self.allowed else ''
      return f'programs identical{except_} ({self.linen_lines} canonical lines)'
    return (
        f'programs differ: first difference at canonical line {self.first_difference}'
        f' of {self.linen_lines} (Linen) / {self.nnx_lines} (NNX); {self.changed_lines}'
        ' lines changed'
        + (f'; {self.loop_growth}' if self.loop_growth and loop_growth else '')
        + one_sided_arguments(self.arguments_only_linen, self.arguments_only_nnx)
    )

  def parting_lines(self) -> list[str]:
    """Where the programs part (`_parting`), a line per operation."""
    return [f'where they part, {side}: {op}'
            for side, ops in (('Linen', self.parting_linen), ('NNX', self.parting_nnx)) for op in ops]

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _clip(line: str, width: int, start: int = 0) -> str:
  """`line` cut to `width` characters, showing the part from about `start` on."""
  if len(line) <= width:
    return line
  lead = 0 if start < width // 2 else min(start - width // 4, len(line) - width + 3)
  text = line[lead:lead + width - 6]
  return ('...' if lead else '') + text + ('...' if lead + width - 6 < len(line) else '')


def _first_difference(a: str, b: str) -> int:
  return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _parting_shown(linen: list[str], nnx: list[str], width: int) -> dict[str, list[str]]:
  """The lines where the programs part, each side's k-th clipped around where its operation differs
  from the other side's k-th: past the value names (hashes of what they compute, which differ
  wherever anything does), so an attribute far along a long line shows."""
  def rhs_start(line):
    lhs, sep, _ = line.partition(' = ')
    return len(lhs) + len(sep) if sep else 0

  starts = []
  for k in range(max(len(linen), len(nnx))):
    if k < len(linen) and k < len(nnx):
      x, y = linen[k], nnx[k]
      i, j = rhs_start(x), rhs_start(y)
      at = _first_difference(x[i:], y[j:])
      starts.append((i + at, j + at))
    else:
      starts.append((0, 0))
  return {'parting_linen': [_clip(line, width, starts[k][0]) for k, line in enumerate(linen)],
          'parting_nnx': [_clip(line, width, starts[k][1]) for k, line in enumerate(nnx)]}


_CALL = re.compile(r'\bcall @')  # `call @f...` and `func.call @f...`


def _parting(a: list[str], b: list[str], most: int = 3) -> tuple[list[int], list[int]]:
  """Where two canonical programs part: on each side, the operations defining values only
  it has from operands both have (arguments, block arguments, values both compute).

  Every other differing operation depends on one of these. The first differing
  line does not tell them apart: statements ready at once are ordered by their
  hashes, so it may be any operation that differs. A changed constant is one
  (it has no operands); an operation added on one side makes its users on
  the other read one value otherwise, so those show too. At most `most` per
  side, in canonical order, calls last; their line indices (names whole, as canonicalize writes them).
  """
  def defined(lines):
    out = []
    for line in lines:
      lhs, sep, rhs = line.partition(' = ')
      names = _VALUE_TOKEN.findall(lhs) if sep and lhs.lstrip().startswith('%') else []
      out.append((names, _VALUE_TOKEN.findall(rhs) if names else []))
    return out

  ours_a, ours_b = defined(a), defined(b)
  values_a = {n for names, _ in ours_a for n in names}
  values_b = {n for names, _ in ours_b for n in names}
  shared = values_a & values_b

  def first(lines, ours, other):
    found = [i for i, (names, operands) in enumerate(ours)
             if names and not set(names) & other and set(operands) <= shared]
    # A call of a function that differs is where they part only because of what the
    # function does inside, whose own parting operations are found too: those first.
    return sorted(found, key=lambda i: _CALL.search(lines[i]) is not None)[:most]

  return first(a, ours_a, values_b), first(b, ours_b, values_a)


def _clip_diff(lines: list[str], width: int) -> list[str]:
  """Unified-diff lines cut to `width`; a changed line pair is cut around its difference (the
  last removed lines of a run beside as many added ones; the rest, each on its own)."""
  out, i = [], 0
  while i < len(lines):
    minus = i
    while minus < len(lines) and lines[minus].startswith('-') and not lines[minus].startswith('---'):
      minus += 1
    plus = minus
    while plus < len(lines) and lines[plus].startswith('+') and not lines[plus].startswith('+++'):
      plus += 1
    if plus == i:  # context, or a file header
      out.append(_clip(lines[i], width))
      i += 1
      continue
    paired = plus - minus if minus - i >= plus - minus else 0  # as many removed lines as added
    out += [_clip(line, width) for line in lines[i:minus - paired]]
    removed, added = lines[minus - paired:minus], lines[minus:plus] if paired else []
    starts = [_first_difference(r[1:], a[1:]) for r, a in zip(removed, added)]
    out += [r[0] + _clip(r[1:], width - 1, k) for r, k in zip(removed, starts)]
    out += [a[0] + _clip(a[1:], width - 1, k) for a, k in zip(added, starts)]
    out += [] if paired else [_clip(line, width) for line in lines[minus:plus]]
    i = plus
  return out


def diff(
    linen_text: str,
    nnx_text: str,
    context: int = 1,
    max_lines: int = 40,
    width: int = 160,
    linen_args: list[str] | None = None,
    nnx_args: list[str] | None = None,
    allowed: tuple[AllowedDifference, ...] = (),
    opaque_modules: tuple[str, ...] = (),
) -> ProgramDiff:
  """Canonicalises both programs and compares them line by line.

  The diff shows at most `max_lines` lines, each cut to `width` characters
  (a changed line around where it changes); hash names are shortened for
  reading (the comparison uses them whole).
  """
  full = [
      canonicalize(linen_text, linen_args, opaque_modules),
      canonicalize(nnx_text, nnx_args, opaque_modules),
  ]
  allowed_names = [a.name for a in allowed]
  if full[0] == full[1]:
    n = len(full[0].splitlines())
    # Loops carrying the same values in another order are the same program (the canonical
    # form orders every loop's carried values by what they are): noted, not a difference.
    loop_order = loop_order_difference(linen_text, nnx_text, reorder_only=True, opaque_modules=opaque_modules)
    return ProgramDiff(True, None, n, n, 0, '', allowed=allowed_names, loop_order=loop_order)
  a, b = (t.splitlines() for t in _short_names(full))
  matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
  opcodes = [op for op in matcher.get_opcodes() if op[0] != 'equal']
  # @main's signature lists its results in the canonical order of their values, so it
  # differs wherever anything does: the first difference shown is the first in a body.
  _, i1, i2, j1, j2 = next(
      (op for op in opcodes if not all(_MAIN_SIGNATURE.match(x) for x in a[op[1]:op[2]] + b[op[3]:op[4]])),
      opcodes[0])
  changed = sum((i2_ - i1_) + (j2_ - j1_) for _, i1_, i2_, j1_, j2_ in opcodes)
  lines = _clip_diff(list(difflib.unified_diff(a, b, 'linen', 'nnx', n=context, lineterm='')), width)
  if len(lines) > max_lines:
    lines = lines[:max_lines] + [f'... ({len(lines) - max_lines} more diff lines)']
  first_a = a[i1].strip() if i1 < i2 else ''
  first_b = b[j1].strip() if j1 < j2 else ''
  start = _first_difference(first_a, first_b)
  every = _parting(full[0].splitlines(), full[1].splitlines(), most=len(a) + len(b))
  parting = tuple(found[:3] for found in every)  # the same as most=3: the order is kept
  changes, reshapes = _value_changes([a[i].strip() for i in every[0]], [b[i].strip() for i in every[1]], width)
  return ProgramDiff(
      False, i1 + 1, len(a), len(b), changed, '\n'.join(lines),
      first_linen=_clip(first_a, width, start), first_nnx=_clip(first_b, width, start),
      **_parting_shown([a[i].strip() for i in parting[0]], [b[i].strip() for i in parting[1]], width),
      allowed=allowed_names,
      loop_growth=loop_carry_growth(linen_text, nnx_text, linen_args, nnx_args),
      value_changes=changes, reshapes=reshapes,
      **_arguments_only(linen_args, nnx_args),
  )


# An operation that only reshapes a value, moving no element (row-major order kept): a
# reshape, a broadcast_in_dim that adds unit axes only, a transpose that moves unit axes only.
_RESHAPE_LIKE = re.compile(
    r'=\s*stablehlo\.(reshape|broadcast_in_dim|transpose)\s+(%\w+)(?:,\s*dims\s*=\s*\[([\d,\s]*)\])?'
    r'\s*:\s*\((tensor<[^<>]*>)\)\s*->\s*(tensor<[^<>]*>)\s*$')
# Operations that differ because what they run differs (a called function, a loop's or a
# conditional's body), whose own differing operations are found too.
_REGION_OP = re.compile(r'=\s*(?:func\.)?call @|=\s*"?stablehlo\.(?:while|case|if)\b')


def _tensor_type(text: str) -> tuple[tuple[int, ...], str] | None:
  """`tensor<8x1xf32>` as ((8, 1), 'f32'); None where a dimension is not a number."""
  parts = text[len('tensor<'):-1].split(',')[0].strip().split('x')
  if not all(p.isdigit() for p in parts[:-1]):
    return None
  return tuple(int(p) for p in parts[:-1]), parts[-1]


def _reshape_key(line: str) -> tuple[str, str] | None:
  """(operand, result type) of an operation that only reshapes its operand (`_RESHAPE_LIKE`);
  None for any other operation."""
  m = _RESHAPE_LIKE.search(line)
  if m is None:
    return None
  op, operand, dims, source, result = m.groups()
  src, dst = _tensor_type(source), _tensor_type(result)
  if src is None or dst is None or src[1] != dst[1] or int(np.prod(src[0])) != int(np.prod(dst[0])):
    return None
  order = [int(d) for d in dims.split(',')] if dims and dims.strip() else []
  if op == 'broadcast_in_dim' and order != sorted(set(order)):
    return None
  if op == 'transpose' and [d for d in order if src[0][d] != 1] != sorted(d for d in order if src[0][d] != 1):
    return None
  return operand, result


def _value_changes(linen: list[str], nnx: list[str], width: int) -> tuple[list[str], list[str]]:
  """Of the operations where two programs part (each side's, as `_parting` finds them): those
  that change values, and the reshapes of one value to one type that both sides make (the
  same numbers, otherwise spelt); each `Linen: <operation>` or `NNX: <operation>`.

  A constant one side has is a change; so is any operation but a reshape (`_reshape_key`), and
  a reshape the other side does not make of the same value to the same type. Operations that
  differ because what they call or loop over differs are left out: what differs inside is
  found too.
  """
  sides = (('Linen', [l for l in linen if not _REGION_OP.search(l)]),
           ('NNX', [l for l in nnx if not _REGION_OP.search(l)]))
  keys = [{_reshape_key(l) for l in lines} - {None} for _, lines in sides]
  changes, reshapes = [], []
  for (name, lines), other in ((sides[0], keys[1]), (sides[1], keys[0])):
    for line in lines:
      key = _reshape_key(line)
      (reshapes if key is not None and key in other else changes).append(f'{name}: {_clip(line, width)}')
  return changes, reshapes


def _arguments_only(linen_args: list[str] | None, nnx_args: list[str] | None) -> dict[str, list[str]]:
  """The argument names of one program only (none unless both programs' names are known)."""
  if linen_args is None or nnx_args is None:
    return {}
  return {'arguments_only_linen': sorted(set(linen_args) - set(nnx_args)),
          'arguments_only_nnx': sorted(set(nnx_args) - set(linen_args))}


def one_sided_arguments(only_linen, only_nnx) -> str:
  """`'; arguments only in Linen: ...; arguments only in NNX: ...'` for those there are ('' if none)."""
  return ''.join(f'; arguments only in {side}: {", ".join(sorted(names))}'
                 for side, names in (('Linen', only_linen), ('NNX', only_nnx)) if names)
