"""The installed package holds only what users import: `parity`.

The wheel is built from a copy of the repository through the build backend
pyproject.toml declares (what `pip wheel .` calls, without its isolated
environment), so the repository's own tree never gets a `build/` folder.
Its files must all lie under `parity/` and its metadata: the reference
decoder (`models/`, `bridge/`) stays in the repository, under generic names
that a user's project or another distribution may own, and so do `tests/`,
`benchmarks/` and the rest. With only the wheel installed, `import models`
fails and `parity compare` without `--pair` exits 2 with one message that
says what to do (parity/run/reference.py).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# What a repository's copy leaves out at its top: hidden folders (.git, the venvs, caches) and
# what a build leaves behind.
TOP_LEVEL_LEFT_OUT = ('build', 'dist', 'runs')

# The build backend's PEP 517 hook, as pip calls it; prints the wheel's file name.
_BUILD = r"""
import importlib, sys, tomllib
with open('pyproject.toml', 'rb') as f:
  backend = tomllib.load(f)['build-system']['build-backend']
print(importlib.import_module(backend).build_wheel(sys.argv[1]))
"""

pytestmark = pytest.mark.xdist_group('packaging')  # one wheel build per worker that runs these


def _copy_ignore(directory, names):
  if pathlib.Path(directory) == REPO:
    return [n for n in names if n.startswith('.') or n in TOP_LEVEL_LEFT_OUT or n.endswith('.egg-info')]
  return [n for n in names if n == '__pycache__']


@pytest.fixture(scope='module')
def wheel(tmp_path_factory) -> pathlib.Path:
  import shutil

  tmp = tmp_path_factory.mktemp('packaging')
  source = tmp / 'linen-nnx-parity'
  shutil.copytree(REPO, source, ignore=_copy_ignore)
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  done = subprocess.run([sys.executable, '-c', _BUILD, str(tmp / 'dist')], cwd=source, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, (
      "building the wheel needs the test extra's setuptools (pip install -e '.[test]'):\n"
      + done.stdout[-3000:] + done.stderr[-3000:])
  return tmp / 'dist' / done.stdout.strip().splitlines()[-1]


def test_the_wheel_holds_the_kit_only(wheel):
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    dist_info = next(n.split('/')[0] for n in names if n.split('/')[0].endswith('.dist-info'))
    top_level = archive.read(f'{dist_info}/top_level.txt').decode().split()
    entry_points = archive.read(f'{dist_info}/entry_points.txt').decode()
  assert sorted({n.split('/')[0] for n in names}) == sorted(['parity', dist_info])
  assert top_level == ['parity']
  # No entry point names a module the wheel does not hold (it would load whatever `bridge` is there).
  assert 'models' not in entry_points and 'bridge' not in entry_points, entry_points
  # The whole kit, nothing of it left out by the package list.
  kit = {p.relative_to(REPO).as_posix() for p in (REPO / 'parity').rglob('*.py')
         if '__pycache__' not in p.parts}
  assert kit <= set(names), sorted(kit - set(names))


def _dependency_dirs() -> list[str]:
  """Where this interpreter has the kit's dependencies: a fresh venv gets them through a .pth
  (the project's own editable install, a .pth's finder in those directories, does not run)."""
  dirs = {str(pathlib.Path(importlib.util.find_spec(name).origin).parents[name.count('.') + 1])
          for name in ('jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint', 'numpy')}
  for where in dirs:
    assert not any((pathlib.Path(where) / name).exists() for name in ('models', 'bridge', 'parity')), (
        f'{where} holds models, bridge or parity: an older non-editable install of this project?')
  return sorted(dirs)


@pytest.mark.exhaustive  # a venv, pip and a jax import: about 15 s on two busy cores
def test_with_only_the_wheel_installed_the_reference_is_not_there(wheel, tmp_path):
  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True, timeout=120)
  python = venv / 'bin' / 'python'
  # The project's pip installs into the new venv (pip --python): the wheel only, nothing fetched.
  done = subprocess.run(
      [sys.executable, '-m', 'pip', '--python', str(python), 'install', '--quiet', '--no-deps',
       '--no-index', '--no-compile', str(wheel)],
      capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  purelib = subprocess.run([str(python), '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'],
                           capture_output=True, text=True, check=True).stdout.strip()
  pathlib.Path(purelib, 'kit_dependencies.pth').write_text('\n'.join(_dependency_dirs()) + '\n')

  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  env['JAX_PLATFORMS'] = 'cpu'
  found = subprocess.run(
      [str(python), '-c', 'import importlib.util as u, parity; print(parity.__file__);'
       ' print(u.find_spec("models"), u.find_spec("bridge"))'],
      cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
  assert found.returncode == 0, found.stderr
  kit_file, specs = found.stdout.splitlines()
  assert kit_file.startswith(purelib), kit_file
  assert specs == 'None None', specs

  compare = subprocess.run([str(venv / 'bin' / 'parity'), 'compare', '--steps', '1'],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
  assert compare.returncode == 2, compare.stdout[-2000:] + compare.stderr[-2000:]
  assert 'Traceback' not in compare.stderr, compare.stderr
  lines = compare.stderr.strip().splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith('parity: error: the reference decoder is not installed'), lines
  assert 'pip install -e .' in lines[0] and '--pair FILE.py:NAME' in lines[0], lines[0]


@pytest.mark.parametrize('argv', [
    ['compare', '--steps', '1'],
    ['compare', '--mesh', 'data=2', '--processes', '2'],  # the launcher asks before it starts one
    ['specs'],
    ['scenarios'],
    ['convert', 'SRC', 'DST', '--to', 'nnx', '--preset', 'tiny'],
], ids=lambda argv: ' '.join(argv[:1] + [a for a in argv if a in ('--processes', '--preset')]))
def test_without_a_checkout_the_reference_commands_exit_2_with_one_message(argv, monkeypatch, capsys):
  """Where `parity` does not run from a checkout (a wheel in site-packages), every command that
  defaults to the reference decoder says what to do instead of a traceback."""
  from parity.run import cli, reference

  monkeypatch.setattr(reference, '_is_checkout', lambda root: False)
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f'parity: error: {reference.NOT_FOUND}'], err


def test_the_repository_is_the_checkout_the_kit_runs_from():
  from parity.run import reference

  assert reference.reference_checkout() == REPO
  found = pathlib.Path(reference.reference_decoder().__file__).resolve()
  assert found == REPO / 'bridge' / 'reference.py'


def test_a_bridge_of_another_project_already_imported_is_named(monkeypatch):
  """The reference is imported from the checkout only: another `bridge` in the process is refused."""
  import types

  from parity.core.errors import BadInput
  from parity.run import reference

  other = types.ModuleType('bridge')
  other.__file__ = '/elsewhere/bridge/__init__.py'
  monkeypatch.setitem(sys.modules, 'bridge', other)
  with pytest.raises(BadInput, match=r'`bridge` is imported from /elsewhere/bridge/__init__.py'):
    reference.reference_decoder()
