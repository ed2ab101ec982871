"""The sharding annotations a lowered program carries (GSPMD and Shardy spellings)."""
from __future__ import annotations

import collections
import re

from parity.compare.programs.text import _strip_locations


# GSPMD: `mhlo.sharding = "{devices=[4,1]<=[4]}"` on arguments and results,
# and `stablehlo.custom_call @Sharding(%x) {mhlo.sharding = "..."}` for a
# constraint. Shardy: `sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}]>`
# on arguments and results, `sdy.sharding_constraint %x <@mesh, [...]>` for a
# constraint, and a per-value `sdy.sharding = #sdy.sharding_per_value<[...]>`
# on other ops.
_GSPMD = re.compile(r'mhlo\.sharding\s*=\s*"((?:[^"\\]|\\.)*)"')
_SDY_ATTR = re.compile(r'sdy\.sharding\s*=\s*#sdy\.sharding(?:_per_value)?<')
_SDY_CONSTRAINT = re.compile(r'sdy\.sharding_constraint\s+%[\w#.$-]+\s*<')


def _angle_block(text: str, open_index: int) -> str:
  """The text between the `<` at open_index and its matching `>`."""
  depth = 0
  for i in range(open_index, len(text)):
    if text[i] == '<':
      depth += 1
    elif text[i] == '>':
      depth -= 1
      if depth == 0:
        return text[open_index + 1:i]
  raise ValueError('unbalanced <...> in a Shardy sharding')


def _normalise(spec: str) -> str:
  return re.sub(r'\s+', ' ', spec.strip())


def sharding_annotations(text: str, mark_signature: bool = False) -> collections.Counter[str]:
  """The multiset of sharding annotations in a lowered program's text.

  Counts argument and result shardings and sharding constraints, in either
  spelling: GSPMD entries as `gspmd:{...}`, Shardy ones as `sdy:<...>` (mesh
  name and dimension shardings). Values are kept verbatim apart from
  whitespace, so two programs with the same shardings, in whatever order,
  give equal counters. Shardy mesh definitions (`sdy.mesh @mesh = <...>`)
  are not annotations and are not counted.

  With `mark_signature`, the shardings of the entry function's arguments and
  results (the state, batch and metrics) are keyed `signature ...`, apart
  from those inside the program (activation constraints and the like).
  """
  text = _strip_locations(text)
  header = re.search(r'^\s*func\.func\s+public\s+@main\(.*$', text, re.MULTILINE)
  in_signature = (lambda i: header.start() <= i < header.end()) if header else (lambda i: False)

  def key(kind: str, index: int) -> str:
    return f'signature {kind}' if mark_signature and in_signature(index) else kind

  found: collections.Counter[str] = collections.Counter()
  for m in _GSPMD.finditer(text):
    found[key(f'gspmd:{_normalise(m.group(1))}', m.start())] += 1
  for pattern in (_SDY_ATTR, _SDY_CONSTRAINT):
    for m in pattern.finditer(text):
      found[key(f'sdy:<{_normalise(_angle_block(text, m.end() - 1))}>', m.start())] += 1
  return found
