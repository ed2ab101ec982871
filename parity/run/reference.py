"""Where the kit finds the reference decoder: the `parity.reference` entry point, never an import by name."""
from __future__ import annotations

from parity.core.errors import BadInput

REFERENCE_GROUP = 'parity.reference'


def reference_decoder():
  """The reference decoder's module (its `configs`, `run_compare`, `specs_command`, ...).

  Found through the `parity.reference` entry point of the installed package,
  never imported by name: the kit imports nothing of the reference decoder,
  so a project's own `models` or `bridge` never shadows it. Commands that
  need it (`specs`, `scenarios`, `compare` without `--pair`, `convert
  --preset`) fail as bad input where it is not installed.
  """
  from importlib.metadata import entry_points

  found = list(entry_points(group=REFERENCE_GROUP, name='decoder'))
  if not found:
    raise BadInput('the reference decoder is not installed (no `parity.reference` entry point):'
                   ' install this repository (pip install -e .) or compare your own pair with --pair')
  return found[0].load()
