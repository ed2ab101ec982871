"""Where each module places its intermediates on a mesh: sharding constraints by module.

On a mesh, a constraint that places an activation otherwise (another
logical name, another rule, a raw `with_sharding_constraint`) makes XLA
split the work otherwise: a reduction summed in another order, a few ULP
apart, while one device computes both sides alike. The program's sharding
constraints carry the module they belong to in their debug locations (Linen
pushes its module paths; the kit names NNX module calls by their Linen
paths while lowering, parity/compare/scopes.py), so the constraints can be
compared module by module: the first module whose constraints differ is
where the placement does.
"""
from __future__ import annotations

import collections
import re

from parity.compare import programs

# A constraint's operation: GSPMD's custom call, or Shardy's own op (its sharding in <...>).
_GSPMD = re.compile(r'custom_call @Sharding\b.*?mhlo\.sharding\s*=\s*"((?:[^"\\]|\\.)*)"')
_SDY = re.compile(r'sdy\.sharding_constraint\s+%[\w#.$-]+\s*<')
_TYPE = re.compile(r'(tensor<[^>]*>)\)?\s*loc\(')


def _constraint(line: str) -> str | None:
  """'type -> sharding' of a line holding a sharding constraint (None: it holds none)."""
  gspmd, sdy = _GSPMD.search(line), _SDY.search(line)
  if gspmd:
    sharding = gspmd.group(1)
  elif sdy:
    sharding = programs._angle_block(line, sdy.end() - 1)
  else:
    return None
  typed = _TYPE.search(line)
  return f'{typed.group(1) if typed else "?"} -> {programs._normalise(sharding)}'


def constraints_by_module(text: str) -> dict[str, collections.Counter]:
  """Each module's sharding constraints in a lowered program's text (`as_text(debug_info=True)`):
  module path -> counter of 'type -> sharding' (the root's own under '')."""
  names = programs._location_names(text)
  out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for line in text.splitlines():
    found = _constraint(line)
    if found is None:
      continue
    loc = programs._TRAILING_LOC.search(line)
    module = '/'.join(programs.module_of(names.get(loc.group(1), ''))) if loc else ''
    out[module][found] += 1
  return dict(out)


def differing_modules(linen: dict[str, collections.Counter],
                      nnx_: dict[str, collections.Counter]) -> list[str]:
  """One line per module whose constraints differ: what only Linen and only NNX places there."""
  lines = []
  for module in sorted(set(linen) | set(nnx_)):
    a, b = linen.get(module, collections.Counter()), nnx_.get(module, collections.Counter())
    if a != b:
      only_a, only_b = sorted((a - b).elements()), sorted((b - a).elements())
      lines.append(f'module {module or "(model)"} places its intermediates otherwise: Linen'
                   f' {only_a or "nothing more"}, NNX {only_b or "nothing more"}')
  return lines


def mesh_lines(mesh, modules_equal: bool, texts: dict[str, str | None] | None) -> list[str]:
  """What the localizer adds on a mesh: the modules that place their intermediates otherwise
  (from the two compared programs, `texts` by side), and where every module's values are
  bitwise, what is left to explain the difference."""
  where = ','.join(f'{name}={size}' for name, size in dict(mesh.shape).items())
  lines = []
  if texts and all(texts.get(name) for name in ('linen', 'nnx')):
    lines = differing_modules(constraints_by_module(texts['linen']), constraints_by_module(texts['nnx']))
    lines = [f'on the mesh ({where}): {line}' for line in lines]
  if modules_equal and not lines:
    lines.append(
        f'on the mesh ({where}) every module output and gradient is bitwise equal and every module'
        ' places its intermediates alike: the difference is in what the step does after the'
        ' gradients (the optimizer update, its reductions over the mesh) or in a placement of'
        ' the state, which the mesh part checks')
  elif modules_equal:
    lines.append(
        'every module output and gradient is bitwise equal from the same state, but the modules'
        ' above place intermediates otherwise: on a mesh XLA splits their work (a reduction) by'
        ' that placement, so later steps can round otherwise; make the constraints agree')
  return lines
