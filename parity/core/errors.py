"""The errors the kit raises on bad input: a tree that does not match its target, a bad command line."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
  """One offending path: what kind of problem, what was expected, what came."""

  path: str
  kind: str  # 'missing', 'extra', 'shape', 'dtype', 'spec', ...
  expected: str
  got: str

  def __str__(self) -> str:
    return f'  {self.path}: {self.kind}: expected {self.expected}, got {self.got}'


class TreeMismatchError(ValueError):
  """Raised when a tree does not match its target; lists every offending path."""

  def __init__(self, what: str, problems: list[Problem]):
    self.what = what
    self.problems = sorted(problems, key=lambda p: (p.path, p.kind))
    lines = [f'{what}: {len(self.problems)} path(s) do not match:']
    lines += [str(p) for p in self.problems]
    super().__init__('\n'.join(lines))


class BadInput(Exception):
  """A user error on the command line: reported in one line, exit status 2."""
