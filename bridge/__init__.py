"""The bridge between the Linen and NNX sides: paths, layouts, specs, train states, checkpoints.

This kit's code is three top-level packages, `bridge`, `models` and
`parity`, installed side by side, and the bridge imports `models`. A
project's own top-level `models` package found first on `sys.path` (in the
directory a test runs from, say) would be imported in its place: that is
said here, when the kit is first used, instead of as an ImportError deep
inside it. A project that has the kit installed and does not use it is left
alone.
"""
import importlib.util as _util
import os as _os


def _check_models_is_the_kits() -> None:
  here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
  spec = _util.find_spec('models')
  locations = list(spec.submodule_search_locations or ()) if spec is not None else []
  if not any(_os.path.dirname(_os.path.abspath(p)) == here for p in locations):
    found = locations[0] if locations else (spec.origin if spec is not None else 'nowhere')
    raise ImportError(
        f'linen-nnx-parity: the top-level package `models` is imported from {found}, not from this'
        f' kit ({_os.path.join(here, "models")}): a `models` package of your project, or of the'
        ' directory you run from, comes first on sys.path. Run from a directory without one, or'
        ' rename yours (this kit installs the top-level packages bridge, models and parity)'
    )


_check_models_is_the_kits()
