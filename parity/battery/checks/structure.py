"""The structure part: both sides' parameter trees, path for path, shape and dtype."""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

from parity.battery.checks.shared import _battery_frames_hidden, _runs
from parity.core.errors import TreeMismatchError
from parity.pairs import adapter


def check_structure(pair: adapter.Pair) -> None:
  __tracebackhide__ = _battery_frames_hidden
  try:
    adapter.check_structure(pair.name, *_runs(pair).sides())
  except TreeMismatchError as e:
    raise AssertionError('\n'.join([str(e), *renamed_parameters(e.problems)])) from None


def renamed_parameters(problems: Sequence[Any]) -> list[str]:
  """The fix where a parameter a module holds itself (`self.param`, an `nnx.Param` attribute) is
  named otherwise on each side: one missing and one extra path under the same module, of the same
  shape and dtype. The module correspondences pair modules, not the parameters they own."""
  missing, extra = {}, {}
  for problem in problems:
    if problem.path.startswith('params/') and problem.kind in ('missing', 'extra'):
      parent, leaf = problem.path.rsplit('/', 1)
      table = missing if problem.kind == 'missing' else extra
      what = problem.expected if problem.kind == 'missing' else problem.got
      table.setdefault((parent, what), []).append(leaf)
  pairs = [(parent, linen[0], extra[parent, what][0]) for (parent, what), linen in sorted(missing.items())
           if len(linen) == 1 and len(extra.get((parent, what), ())) == 1]
  if not pairs:
    return []
  named = ', '.join(f'{parent}/{a} (NNX: {b})' for parent, a, b in pairs)
  top = [(a, b) for parent, a, b in pairs if parent == 'params']  # the model's own: no module renamed
  fix = (f'renames=parity.Renames(({", ".join(f"({a!r}, {b!r})" for a, b in top)},))' if len(top) == len(pairs)
         else 'a parity.Renames entry from each Linen path to the NNX one (the module path as the NNX'
              ' side names it: `parity renames --pair FILE.py:NAME` prints the table to extend)')
  return [
      f'parameters named otherwise on each side, of one shape and dtype under one module: {named}. If'
      f' they are the same parameters, rename them on the NNX side: {fix} (model_pair:'
      " nnx_options={'renames': ...}; a StockNnx: renames=...). A rename maps whole path components,"
      ' a parameter\'s name included; the module correspondences pair modules, not the parameters a'
      ' module holds itself']


@contextlib.contextmanager
def _as_failure():
  """The bridge's TreeMismatchError (every differing path) as the check's failure: an
  AssertionError with the same message, shown without the bridge's frames."""
  try:
    yield
  except TreeMismatchError as e:
    raise AssertionError(str(e)) from None
