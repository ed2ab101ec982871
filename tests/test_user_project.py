"""The kit as a library: one public import, layers that never reach the reference decoder,
and a user's project with its own `models.py`, `bridge.py` and `configs/` that runs unchanged.

The reference decoder (`models`, `bridge`) is installed beside the kit as its
first client; the kit (`parity`) must import nothing of it, or a project's own
`models` or `bridge` module, first on `sys.path` under pytest, would replace it.
"""
from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
KIT = REPO / 'parity'
USER_PROJECT = pathlib.Path(__file__).resolve().parent / 'fixtures' / 'user_project'
CLIENT_PACKAGES = ('models', 'bridge')


def _kit_modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in sorted(KIT.rglob('*.py')):
    parts = list(path.relative_to(REPO).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts.pop()
    modules['.'.join(parts)] = path
  return modules


def _imports(tree: ast.AST, module: str, is_package: bool, top_level_only: bool) -> list[str]:
  """Modules a module's source imports (absolute names), every statement or its top level only."""
  nodes = tree.body if top_level_only else ast.walk(tree)
  found = []
  for node in nodes:
    if isinstance(node, ast.Import):
      found += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: resolved against the importing module's package
        base = module.split('.')
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        name = '.'.join(base + ([node.module] if node.module else []))
      else:
        name = node.module
      found.append(name)
      found += [f'{name}.{alias.name}' for alias in node.names]  # `from pkg import module`
  return found


def test_the_kit_imports_nothing_of_the_reference_decoder():
  """Every import statement of every kit module, function-level ones included."""
  offenders = []
  for module, path in _kit_modules().items():
    tree = ast.parse(path.read_text(), str(path))
    for name in _imports(tree, module, path.name == '__init__.py', top_level_only=False):
      if name.split('.')[0] in CLIENT_PACKAGES:
        offenders.append(f'{path.relative_to(REPO)}: imports {name}')
  assert not offenders, '\n'.join(offenders)


def test_the_kits_modules_import_each_other_without_cycles():
  """Module-level imports between the kit's modules form no cycle."""
  modules = _kit_modules()
  graph = {}
  for module, path in modules.items():
    tree = ast.parse(path.read_text(), str(path))
    names = _imports(tree, module, path.name == '__init__.py', top_level_only=True)
    graph[module] = sorted({n for n in names if n in modules and n != module})
  state: dict[str, int] = {}
  cycles = []

  def visit(node, trail):
    state[node] = 1
    for nxt in graph[node]:
      if state.get(nxt) == 1:
        cycles.append(' -> '.join(trail[trail.index(nxt):] + [nxt]))
      elif nxt not in state:
        visit(nxt, trail + [nxt])
    state[node] = 2

  for module in graph:
    if module not in state:
      visit(module, [module])
  assert not cycles, '\n'.join(cycles)


def test_every_subpackage_says_what_it_is_for():
  for package in sorted(p for p in KIT.iterdir() if (p / '__init__.py').is_file()):
    doc = ast.get_docstring(ast.parse((package / '__init__.py').read_text()))
    assert doc and len(doc.splitlines()) == 1, f'{package.name}/__init__.py: a one-line docstring'


def _user_env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'XLA_FLAGS', 'PJRT_NPROC')}
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def test_the_public_import_and_every_kit_module_leave_a_users_models_and_bridge_alone(tmp_path):
  """Run from a directory whose `models.py` and `bridge.py` fail on import: importing
  `parity`, resolving every public name and importing every kit module never touches them."""
  for name in CLIENT_PACKAGES:
    (tmp_path / f'{name}.py').write_text(f"raise ImportError('the kit imported the user\\'s {name}')\n")
  script = (
      'import importlib, pkgutil, sys\n'
      'import parity\n'
      'print(parity.Pair, parity.StockLinen, parity.StockNnx, parity.Renames, parity.KnownDifference)\n'
      'for name in parity.__all__:\n'
      '  getattr(parity, name)\n'
      'for info in pkgutil.walk_packages(parity.__path__, "parity."):\n'
      '  if info.name != "parity.__main__":\n'
      '    importlib.import_module(info.name)\n'
      'assert not [m for m in sys.modules if m.split(".")[0] in ("models", "bridge")]\n'
      'print("ok", len(parity.__all__))\n'
  )
  done = subprocess.run([sys.executable, '-c', script], cwd=tmp_path, env=_user_env(),
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "<class 'parity.pairs.adapter.Pair'>" in done.stdout and 'ok ' in done.stdout


@pytest.fixture
def user_project(tmp_path):
  project = tmp_path / 'project'
  shutil.copytree(USER_PROJECT, project, ignore=shutil.ignore_patterns('__pycache__'))
  assert not str(project).startswith(str(REPO))
  return project


def test_a_users_project_with_its_own_models_bridge_and_configs_gets_the_battery(user_project):
  """The user's test imports their `models`, `bridge` and `configs` and only `parity` of
  the kit; pytest (the test's directory first on sys.path) runs every part of the battery."""
  done = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist'],
      cwd=user_project, env=_user_env(), capture_output=True, text=True, timeout=900,
  )
  out = done.stdout + done.stderr
  assert done.returncode == 0, out[-6000:]
  assert '19 passed' in out, out[-3000:]


def test_parity_compare_runs_a_users_pair_beside_their_own_models(user_project):
  done = subprocess.run(
      [sys.executable, '-m', 'parity', 'compare', '--pair', 'test_mlp_migration.py:mlp', '--steps', '3'],
      cwd=user_project, env=_user_env(), capture_output=True, text=True, timeout=600,
  )
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  assert 'bit-identical' in done.stdout, done.stdout[-3000:]
