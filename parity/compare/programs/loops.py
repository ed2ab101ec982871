"""Loops whose carried values the two sides order otherwise, and the differences allowed by design."""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import numpy as np

from parity.compare.programs.names import _mark_opaque
from parity.compare.programs.text import _indent_of, _split_top_level, _strip_locations


@dataclasses.dataclass(frozen=True)
class AllowedDifference:
  """A difference between the sides inherent to the frameworks, removed before comparing.

  Each one is removed by one exact change to what is traced (never a
  pattern over the program text), so everything else still has to match.
  """

  name: str
  reason: str
  nnx_dtype: Any = None


STEP_COUNTER_DTYPE = AllowedDifference(
    name='step counter dtype',
    reason=(
        "Linen's TrainState counts steps in int32 and nnx.Optimizer in uint32 (the bridge"
        " converts the value exactly). The Linen step is compared as traced with a uint32"
        ' counter: its own code, the counter\'s dtype the only change.'
    ),
    nnx_dtype=np.uint32,
)

# Every difference the program comparison allows, with its reason.
ALLOWED: tuple[AllowedDifference, ...] = (STEP_COUNTER_DTYPE,)


_WHILE_TYPES = re.compile(r'stablehlo\.while\((?:[^()]|\([^()]*\))*\)\s*:\s*([^\n]*)')


def loop_carries(text: str, opaque_modules: tuple[str, ...] = ()) -> list[list[str]]:
  """Each `stablehlo.while` of a lowered program, in text order: the types it carries, in order.

  Types, not values: two carried values of one type trading places are not
  told apart here (the canonical comparison still sees what each computes).
  A loop located in one of `opaque_modules` (needs the text with debug
  locations) is left out: how such a module computes is not compared.
  """
  if opaque_modules:
    text = _without_loops_in(text, opaque_modules)
  text = _strip_locations(text)
  return [_split_top_level(m.group(1).strip()) for m in _WHILE_TYPES.finditer(text)]


def _without_loops_in(text: str, modules: tuple[str, ...]) -> str:
  """`text` without the headers of the loops located in one of `modules` (a loop's location is
  on the line closing it)."""
  lines = _mark_opaque(text, modules).splitlines()
  out = list(lines)
  for i, line in enumerate(lines):
    if 'stablehlo.while(' not in line:
      continue
    indent = _indent_of(line)
    end = next((k for k in range(i + 1, len(lines)) if _indent_of(lines[k]) == indent
                and lines[k].strip().startswith('}') and not lines[k].strip().startswith('} do')), None)
    if end is not None and '\u27e6opaque' in lines[end]:
      out[i] = ''
  return '\n'.join(out)


def _unpaired_loops(a: list[list[str]], b: list[list[str]]):
  """The loops (index, carried types) of each side left when each loop is paired with one of
  the other side's carrying the same sequence of types, first come first paired."""
  left_b = list(enumerate(b))
  left_a = []
  for k, x in enumerate(a):
    j = next((j for j, (_, y) in enumerate(left_b) if y == x), None)
    if j is None:
      left_a.append((k, x))
    else:
      del left_b[j]
  return left_a, left_b


def loop_order_difference(
    linen_text: str, nnx_text: str, reorder_only: bool = False, opaque_modules: tuple[str, ...] = ()
) -> str:
  """'' when both programs' loops carry the same types in the same order; else where they differ.

  Not a difference of programs (`diff` reads every loop's carried order
  away): a note of what XLA schedules from. `reorder_only`: only a loop
  carrying the same values in another order is reported.

  Loops are paired by what they carry, not by their place in the text: the
  two sides may print their private functions, and so their loops, in
  another order. A Linen loop with no NNX loop carrying the same sequence is
  reported, against an unpaired NNX loop carrying the same types in another
  order if there is one.
  """
  a, b = loop_carries(linen_text, opaque_modules), loop_carries(nnx_text, opaque_modules)
  if len(a) != len(b):
    return '' if reorder_only else f'Linen has {len(a)} loops, NNX {len(b)}'
  unpaired_linen, unpaired_nnx = _unpaired_loops(a, b)
  if not unpaired_linen:
    return ''
  k, x = unpaired_linen[0]
  same_types = [(m, y) for m, y in unpaired_nnx if sorted(y) == sorted(x)]
  if not same_types:
    return '' if reorder_only else f'loop {k} (of {len(a)}, in program order) carries other types'
  m, y = same_types[0]
  where = (
      f'loop {k} (of {len(a)}, in program order) carries' if m == k
      else f"Linen's loop {k} and NNX's loop {m} (of {len(a)}, in program order) carry"
  )
  i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
  return (
      f'{where} the same {len(x)} values in another'
      f' order, from value {i} on: Linen {", ".join(x[i:i + 3])}, ...; NNX'
      f' {", ".join(y[i:i + 3])}, ... (e.g. nnx.scan flattens a module\'s state by path,'
      " while Linen's nn.scan takes one collection after another: in an nnx.scan of your"
      " own, nnx.StateAxes orders them as Linen does; under remat, Linen's collections enter"
      " in name order: split the NNX state by filters in that order. flax's own loops, as"
      " nnx.RNN's beside nn.RNN's, keep their order)"
  )


_MAIN_SIGNATURE = re.compile(r'\s*func\.func public @main\(')
_MAIN_ARGUMENT = re.compile(r'%arg(\d+): (tensor<[^>]*>)')


def _parameter_types(text: str, names: list[str] | None) -> list[str]:
  """The types of the program's parameter arguments (`params/...` by name)."""
  if names is None:
    return []
  main = re.search(r'func\.func public @main\((.*?)\)\s*->', text, re.S)
  if main is None:
    return []
  return [t for k, t in _MAIN_ARGUMENT.findall(main.group(1))
          if int(k) < len(names) and names[int(k)].startswith('params/')]


def loop_carry_growth(
    linen_text: str, nnx_text: str, linen_args: list[str] | None = None, nnx_args: list[str] | None = None
) -> str:
  """'' unless a loop of one side carries what its counterpart carries and more; else which, and what.

  Loops carrying the same sequence of types pair first; a loop left is
  paired with one of the other side's left whose carried types include all
  of its own. Where the values only NNX carries each have a parameter's type
  (`params/...` arguments, by the names given), the usual cause is named: a
  module's state coming back out of a transformed call (`nnx.remat` over a
  module returns it, and a scan then carries it through the loop).
  """
  a, b = loop_carries(linen_text), loop_carries(nnx_text)
  left_a, left_b = _unpaired_loops(a, b)

  def extra(big: list[str], small: list[str]) -> list[str] | None:
    counts = collections.Counter(big)
    counts.subtract(small)
    if len(big) <= len(small) or any(v < 0 for v in counts.values()):
      return None
    return list(counts.elements())

  for k, x in left_a:
    for m, y in left_b:
      for more, fewer, what, (i, j), side_text, side_args in (
          ('NNX', 'Linen', extra(y, x), (m, k), nnx_text, nnx_args),
          ('Linen', 'NNX', extra(x, y), (k, m), linen_text, linen_args),
      ):
        if what is None:
          continue
        shown = ', '.join(what[:4]) + (', ...' if len(what) > 4 else '')
        line = (f"{more}'s loop {i} carries {len(what)} values more than {fewer}'s loop {j}"
                f' (of {len(a)}, in program order): {shown}')
        params = collections.Counter(_parameter_types(side_text, side_args))
        if more == 'NNX' and params and not collections.Counter(what) - params:
          line += (', each of a parameter\'s type: a module\'s state coming back out of a transformed'
                   ' call, as `nnx.remat` over a module returns it; `jax.checkpoint` over the state'
                   ' `nnx.split` gives, merged inside, takes it in only, as Linen\'s `nn.remat` does')
        return line
  return ''
