"""Where the kit finds the reference decoder: in the checkout of this repository that `parity` runs from.

The installed package holds the kit only (`parity`): the reference decoder
(`models/`, `bridge/`) stays in the repository, so installing the kit never
claims those generic top-level names, which a user's project or another
distribution may own. The reference is found where the running `parity`
package itself lives in a checkout (an editable install, `pip install -e .`,
or `python -m parity` from the repository's root): kit and reference then
come from the same tree, and the command never imports code from whatever
directory it happens to run in.
"""
from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

from parity.core.errors import BadInput

PROJECT = 'linen-nnx-parity'
REFERENCE_MODULE = 'bridge.reference'
# The reference's top-level packages, beside `parity/` in a checkout.
REFERENCE_PACKAGES = ('models', 'bridge')

NOT_FOUND = (
    'the reference decoder is not installed: it lives in the repository (models/, bridge/), not in'
    ' the `parity` package. Run from a checkout of the repository installed with `pip install -e .`'
    ' (or `python -m parity` from its root), or compare your own pair with --pair FILE.py:NAME'
)


def _is_checkout(root: pathlib.Path) -> bool:
  """Whether `root` is this repository: its pyproject names the project and the reference is there."""
  import tomllib

  try:
    with open(root / 'pyproject.toml', 'rb') as f:
      name = tomllib.load(f).get('project', {}).get('name')
  except (OSError, tomllib.TOMLDecodeError):
    return False
  return name == PROJECT and (root / 'bridge' / 'reference.py').is_file() and (
      root / 'models' / '__init__.py').is_file()


def reference_checkout() -> pathlib.Path:
  """The checkout the running `parity` package comes from; bad input where there is none.

  Imports nothing: the `--processes` launcher asks before it starts any process.
  """
  import parity

  root = pathlib.Path(parity.__file__).resolve().parent.parent
  if not _is_checkout(root):
    raise BadInput(NOT_FOUND)
  return root


def _inside(module, root: pathlib.Path) -> bool:
  where = getattr(module, '__file__', None)
  return where is not None and pathlib.Path(where).resolve().is_relative_to(root)


def _found_in(name: str, root: pathlib.Path) -> bool:
  spec = importlib.util.find_spec(name)
  return (spec is not None and spec.origin is not None
          and pathlib.Path(spec.origin).resolve().is_relative_to(root))


def _check_not_shadowed(root: pathlib.Path) -> None:
  for name in REFERENCE_PACKAGES:
    module = sys.modules.get(name)
    if module is not None and not _inside(module, root):
      raise BadInput(
          f'`{name}` is imported from {getattr(module, "__file__", None) or repr(module)}, not from the'
          f' checkout {root} that holds the reference decoder: run from another directory, or'
          ' compare your own pair with --pair FILE.py:NAME'
      )


def reference_decoder():
  """The reference decoder's module (its `pair`, `configs`, `specs_command`, ...).

  Commands that need it (`specs`, `scenarios`, `compare` without `--pair`,
  `convert --preset`) fail as bad input where the kit does not run from a
  checkout, or where a `models` or `bridge` of another project is what
  imports under those names.
  """
  root = reference_checkout()
  _check_not_shadowed(root)
  # An editable install maps only `parity`: the reference's packages import from the checkout's
  # root, put first where another directory on the path would answer for them (found, not run).
  if any(name not in sys.modules and not _found_in(name, root) for name in REFERENCE_PACKAGES):
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
  module = importlib.import_module(REFERENCE_MODULE)
  _check_not_shadowed(root)
  return module
