"""The pytest plugin, run as a user runs it: the README's example in a fresh directory.

The README's declaration (the classifier family) is copied into a new
directory outside this repository, with a copy of the repository's `models/`
beside it (the example's model code: the installed package is the kit only),
and pytest runs there with nothing but the installed package (no path into
the repository). A second pair in the same
file has its NNX side broken on purpose (another dropout rate), so its
generated tests must fail with the bitwise report and the localizer's
finding; `--parity-parts` must select parts. The directory gets none of this
suite's XLA set-up: the plugin asks for the CPU devices its meshes take.
"""
from __future__ import annotations

import pathlib
import re
import shutil
import types

import pytest

pytest_plugins = ['pytester']

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'

BROKEN_PAIR = '''

import dataclasses


def broken_sides(mesh):
  linen, nnx_side = make_sides(mesh)
  other = dataclasses.replace(CFG, dropout_rate=0.2)
  return linen, dataclasses.replace(
      nnx_side, create=functools.partial(nnx_classifier.create_train_state, other)
  )


broken = parity.Pair('broken', broken_sides, functools.partial(classifier_batch, CFG))
'''


def readme_example() -> str:
  text = README.read_text()
  block = text.split('<!-- plugin-example -->', 1)[1].split('```python\n', 1)[1]
  return block.split('```', 1)[0]


@pytest.fixture
def user_project(pytester, monkeypatch):
  monkeypatch.delenv('PYTHONPATH', raising=False)  # only the installed package
  # Nothing of this suite's XLA set-up (8 CPU devices, its flags): the plugin's own.
  monkeypatch.delenv('XLA_FLAGS', raising=False)
  monkeypatch.delenv('PJRT_NPROC', raising=False)
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  pytester.makepyfile(test_classifier_migration=readme_example() + BROKEN_PAIR)
  # The example's models are the repository's, not the package's (tests/test_packaging.py).
  shutil.copytree(README.parent / 'models', pytester.path / 'models',
                  ignore=shutil.ignore_patterns('__pycache__'))
  assert not str(pytester.path).startswith(str(README.parent))
  return pytester


def test_a_declared_pair_becomes_the_battery(user_project):
  result = user_project.runpytest_subprocess('--collect-only', '-q', '-p', 'no:cacheprovider')
  ids = [line for line in result.outlines if '::' in line]
  broken = [i.split('::', 1)[1] for i in ids if '::broken::' in i]
  assert len(ids) == 2 * len(broken)  # the README's pair and the broken one
  assert broken == [
      'broken::test_structure', 'broken::test_specs', 'broken::test_init', 'broken::test_grads',
      'broken::test_train[linen]', 'broken::test_train[nnx]', 'broken::test_eval',
      'broken::test_checkpoints[linen->linen]', 'broken::test_checkpoints[linen->nnx]',
      'broken::test_checkpoints[nnx->linen]', 'broken::test_checkpoints[nnx->nnx]',
      'broken::test_resume[linen->nnx]', 'broken::test_resume[nnx->linen]',
      'broken::test_convert[linen->nnx]', 'broken::test_convert[nnx->linen]',
      'broken::test_mesh[data=8]', 'broken::test_memory', 'broken::test_program',
      'broken::test_localize',
  ]


def test_a_pairs_parts_form_three_groups_that_compile_apart(user_project):
  """Under xdist one pair uses three workers: the parts that train on one device share one group
  (one compiled train step per side), the mesh parts another, the parts with programs of their own
  a third."""
  user_project.makeconftest('''
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
  for item in items:
    print('GROUP', item.nodeid.split('::', 1)[1], item.get_closest_marker('xdist_group').args[0])
''')
  result = user_project.runpytest_subprocess('--collect-only', '-q', '-s', '-p', 'no:cacheprovider', '-k', 'broken')
  groups = dict(line.split()[1:] for line in result.outlines if line.startswith('GROUP '))
  own = {test for test, group in groups.items() if group == 'parity-broken/own-programs'}
  mesh = {test for test, group in groups.items() if group == 'parity-broken/mesh'}
  assert own == {'broken::test_specs', 'broken::test_grads', 'broken::test_localize'}, groups
  assert mesh and all(test.startswith('broken::test_mesh[') for test in mesh), groups
  assert {groups[test] for test in set(groups) - own - mesh} == {'parity-broken'}, groups


@pytest.mark.exhaustive
def test_a_broken_pair_fails_with_the_bitwise_report_and_the_localizer(user_project):
  # Strict projects too: findings go to the JUnit XML without pytest's xunit2 warning
  # (`record_property is incompatible with junit_family 'xunit2'`), an error here. The
  # filter names that warning: another installed plugin's warnings are not the plugin's
  # (pytest-benchmark warns at start-up whenever xdist is installed too).
  result = user_project.runpytest_subprocess(
      '--parity-parts=structure,grads', '-p', 'no:cacheprovider', '--junitxml=report.xml',
      '-W', 'error:record_property is incompatible:pytest.PytestWarning',
  )
  result.assert_outcomes(passed=3, failed=1)  # the README's pair passes both parts
  assert '<property name="declared_differences" value="[]"' in (user_project.path / 'report.xml').read_text()
  result.stdout.fnmatch_lines([
      '*broken: loss and gradients are not bit-identical*(values: Linen vs NNX)',
      '*localizer (step 0, train mode):*',  # the finding first, then the leaves that differ
      '*forward pass: first differs at module Dropout_0*',
      '*params/Dense_0/kernel: bits: float32*max ULP distance*',
  ])
  # The failure shows the test's line and the message, not the battery's source.
  result.stdout.no_fnmatch_line('*raise _with_localization*')


AFTER_LINEN = '''
# test_after_linen.py: the README's pair once its Linen code is deleted
import sys
sys.modules['models.linen.classifier'] = None  # gone: importing it raises ImportError

import functools

import parity
from models.families import ClassifierConfig, classifier_batch
from models.nnx import classifier as nnx_classifier

CFG = ClassifierConfig()
BASELINE = parity.recorded('records/classifier')  # `parity record`, before the Linen code went


def make_sides(mesh):
  nnx_side = parity.StockNnx(
      functools.partial(nnx_classifier.create_train_state, CFG), nnx_classifier.train_step,
      nnx_classifier.eval_step, nnx_classifier.loss_fn, mesh=mesh,
  )
  return BASELINE.side(mesh), nnx_side


classifier = parity.Pair('classifier', make_sides, functools.partial(classifier_batch, CFG),
                         parts=('structure', 'train', 'checkpoints'))
'''


def test_a_pair_recorded_before_linen_went_runs_its_battery_against_the_record(user_project):
  """`parity record` on the README's pair, then the pair declared with the record for its Linen
  side and the Linen module unimportable: the plugin's parts compare the NNX side with the
  record; those that need Linen alive are skipped, each saying why."""
  import subprocess
  import sys

  done = subprocess.run([sys.executable, '-m', 'parity', 'record', '--pair', 'test_classifier_migration.py:classifier',
                         '--parts', 'structure,train', 'records/classifier'],
                        cwd=user_project.path, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr
  assert 'parity record: classifier: 2 parts recorded in records/classifier' in done.stderr, done.stderr
  user_project.makepyfile(test_after_linen=AFTER_LINEN)
  result = user_project.runpytest_subprocess('-p', 'no:cacheprovider', 'test_after_linen.py', '-rs')
  # structure, train from either init, the NNX side's own checkpoint round trip; the three others skipped.
  result.assert_outcomes(passed=4, skipped=3)
  result.stdout.fnmatch_lines(['*checkpoints (linen->nnx) is not checked against the record */records/classifier:'
                               ' saving on one side and restoring on the other needs both sides alive*'])


RAISING_PAIR = '''

import dataclasses


def _create_raises(seed):
  raise ValueError('planted: the NNX create cannot build its model')


def raising_sides(mesh):
  linen, nnx_side = make_sides(mesh)
  return linen, dataclasses.replace(nnx_side, create=_create_raises)


raising = parity.Pair('raising', raising_sides, functools.partial(classifier_batch, CFG))
'''


def test_a_create_that_raises_shows_its_traceback_once(user_project):
  """Every part needs the sides' states: the first part that builds one shows the error with
  its traceback, every other part fails in one line that names it."""
  user_project.makepyfile(test_raising=readme_example() + RAISING_PAIR)
  result = user_project.runpytest_subprocess('-p', 'no:cacheprovider', 'test_raising.py::raising',
                                             '--parity-parts=structure,init,grads,train,eval,checkpoints')
  outcomes = result.parseoutcomes()
  assert outcomes.get('failed', 0) >= 6 and not outcomes.get('passed'), outcomes
  text = result.stdout.str()
  assert text.count("raise ValueError('planted: the NNX create cannot build its model')") == 1, text
  # Anchored at the line's start: pytest's short summary repeats each message after 'FAILED',
  # untruncated where the CI variable is set.
  assert len(re.findall(r'^raising: .* whose report shows the traceback: ValueError: planted: the NNX'
                        r' create cannot build its model$', text, re.M)) == outcomes['failed'] - 1, text


@pytest.mark.parametrize('option,message', [
    ('structure,bogus', "unknown part(s) ?'bogus'?"),
    ('', 'no part named'),  # would otherwise run every part
], ids=['unknown', 'empty'])
def test_an_unknown_part_is_a_usage_error(user_project, option, message):
  result = user_project.runpytest_subprocess(f'--parity-parts={option}', '-p', 'no:cacheprovider')
  assert result.ret == pytest.ExitCode.USAGE_ERROR
  result.stderr.fnmatch_lines([f'ERROR: --parity-parts: {message}; parts: structure, *'])


@pytest.mark.exhaustive
@pytest.mark.parametrize('parts', ["'grads'", "('grad', 'train')"], ids=['a_string', 'a_misspelt_name'])
def test_a_pair_with_an_unknown_part_fails_collection(user_project, parts):
  """Not a pair with fewer tests, or none, in silence."""
  user_project.makepyfile(test_typo=readme_example() + f"\ntypo = parity.Pair('typo', make_sides, functools.partial(classifier_batch, CFG), parts={parts})\n")
  result = user_project.runpytest_subprocess('--collect-only', '-q', '-p', 'no:cacheprovider', 'test_typo.py')
  assert result.ret == pytest.ExitCode.INTERRUPTED, result.outlines  # pytest's status for collection errors
  result.stdout.fnmatch_lines([
      '*ERROR collecting test_typo.py*',
      "Pair 'typo': parts must be a sequence of part names, got unknown *; parts: structure, specs, *",
  ])


@pytest.mark.exhaustive
def test_the_mesh_part_gets_its_cpu_devices_from_the_plugin(user_project):
  """The default mesh, data=8, on a CPU host of any core count: the plugin sets 8 CPU devices."""
  result = user_project.runpytest_subprocess('--parity-parts=mesh', '-k', 'not broken', '-p', 'no:cacheprovider')
  result.assert_outcomes(passed=1)


@pytest.mark.exhaustive
def test_meshes_of_two_sizes_are_a_usage_error(user_project):
  result = user_project.runpytest_subprocess(
      '--parity-mesh=data=8', '--parity-mesh=data=4', '-p', 'no:cacheprovider')
  assert result.ret == pytest.ExitCode.USAGE_ERROR
  result.stderr.fnmatch_lines(['ERROR: --parity-mesh: *data=8*data=4* take ?4, 8? devices; a mesh spans every device*'])


def test_a_session_without_a_pair_keeps_its_xla_flags(pytester, monkeypatch):
  """The plugin is active wherever the package is installed: a project with no pair keeps its XLA set-up."""
  monkeypatch.delenv('XLA_FLAGS', raising=False)
  pytester.makepyfile(test_plain='''
import os

def test_no_flags_were_set():
    assert os.environ.get('XLA_FLAGS', '') == ''
''')
  pytester.runpytest_subprocess('-p', 'no:cacheprovider').assert_outcomes(passed=1)


@pytest.mark.parametrize('dist', [None, 'load'], ids=['default', 'given'])
def test_under_n_a_pairs_group_stays_on_one_worker_unless_a_distribution_is_given(pytester, dist):
  """xdist distributes by `load` under `-n`, spreading a pair's tests over the workers (each
  compiling); the plugin makes it `loadgroup`, workers included, unless the run names one."""
  pytester.makepyfile(test_grouped=(
      'import pytest\n'
      '@pytest.mark.xdist_group("pair")\n'
      'def test_one(request):\n'
      '  assert request.config.getoption("loadgroup", None) is not None\n'
  ))
  args = ['-n', '2', '-p', 'no:cacheprovider', '-rA'] + ([] if dist is None else ['--dist', dist])
  result = pytester.runpytest_subprocess(*args)
  result.assert_outcomes(passed=1)
  applied = ("parity: --dist loadgroup (a pair's parts that train on one device on one worker, its mesh parts on"
             ' another, those with programs of their own on a third; a worker fails them if the grouping did not'
             ' take effect; give --dist to choose another)')
  if dist is None:
    result.stdout.fnmatch_lines([applied, '*PASSED test_grouped.py::test_one@pair*'])
  else:
    assert applied not in result.stdout.str()
    result.stdout.fnmatch_lines(['*PASSED test_grouped.py::test_one'])


class _Item:
  """A collected test as the plugin's grouping guard reads it."""

  def __init__(self, nodeid, config):
    self.nodeid, self.config = nodeid, config

  def get_closest_marker(self, name):
    return pytest.mark.xdist_group('parity-x').mark if name == 'xdist_group' else None


@pytest.mark.parametrize('suffix, fails', [('@parity-x', False), ('', True)])
def test_a_worker_whose_grouping_did_not_take_effect_fails_every_test(pytestconfig, suffix, fails):
  """pytest 9.2 with xdist 3.8 drops loadgroup's `@group` suffix (pytest-dev/pytest-xdist#1386):
  a worker that sees its grouped tests without it fails each test, naming the cause, instead of
  letting every worker compile every pair again."""
  from parity.battery import plugin

  config = types.SimpleNamespace(option=types.SimpleNamespace(loadgroup=True), stash=pytest.Stash())
  item = _Item('test_x.py::pair::test_grads' + suffix, config)
  plugin.pytest_collection_finish(types.SimpleNamespace(config=config, items=[item]))
  if not fails:
    plugin.pytest_runtest_setup(item)
    return
  with pytest.raises(pytest.fail.Exception, match=r'--dist loadgroup is not grouping tests here \(1 grouped'
                     r' tests lack their @group suffix\).*pytest-xdist#1386. Install a pytest below 9.2'):
    plugin.pytest_runtest_setup(item)


def test_the_battery_keeps_its_compiled_programs_in_the_projects_pytest_cache(user_project, monkeypatch):
  """A user's project with no compilation cache of its own gets jax's persistent cache in its
  `.pytest_cache`: a second run of a pair loads its programs instead of compiling them. The
  structure part is the cheapest that compiles (the sides' creation runs jax ops)."""
  monkeypatch.delenv('JAX_COMPILATION_CACHE_DIR', raising=False)
  result = user_project.runpytest_subprocess('--parity-parts=structure', '-k', 'classifier and not broken')
  result.assert_outcomes(passed=1)
  cache = user_project.path / '.pytest_cache' / 'd' / 'parity-jax-compilation-cache'
  assert cache.is_dir() and any(cache.iterdir()), sorted(user_project.path.rglob('*'))[:20]


def test_a_compilation_cache_of_ones_own_keeps_the_programs_compiled_in_under_a_second(user_project, monkeypatch,
                                                                                          tmp_path):
  """JAX_COMPILATION_CACHE_DIR of the user's own, nothing else set, `-p no:cacheprovider`: the
  plugin still sets the minimum compile time and entry size to 0, so the structure part's small
  programs (each compiled in well under a second) are written there."""
  own = tmp_path / 'own-cache'
  monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', str(own))
  for name in ('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', 'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES',
               'JAX_COMPILATION_CACHE_MAX_SIZE'):
    monkeypatch.delenv(name, raising=False)
  result = user_project.runpytest_subprocess('--parity-parts=structure', '-p', 'no:cacheprovider',
                                             '-k', 'classifier and not broken')
  result.assert_outcomes(passed=1)
  assert own.is_dir() and any(own.iterdir()), sorted(tmp_path.rglob('*'))[:20]


def test_parity_programs_lists_each_tests_programs_and_the_parts_that_share_them(user_project):
  """`--parity-programs`: every program a test asked for, by the kit's names. The grads part asks for one
  loss-and-grad per side and the localizer, which reads them, for none; the totals close the table."""
  result = user_project.runpytest_subprocess(
      '--parity-parts=structure,grads,localize', '--parity-programs', '-p', 'no:cacheprovider',
      '-k', 'classifier and not broken')
  result.assert_outcomes(passed=3)
  out = result.stdout.str()
  table = out.split('parity: XLA programs asked for, by test', 1)[1]
  count, rest = table.split('classifier::test_grads: ', 1)[1].split(' program(s)\n', 1)
  names = [line.split()[0] for line in rest.splitlines()[:int(count)]]  # the start's init and batches too
  assert names.count('jit_loss_and_grads_probe') == 2, table
  none = table.split('asked for no program (every one they ran was compiled already):', 1)[1]
  assert 'classifier::test_localize' in none.split('programs asked for', 1)[0], table
  assert re.search(r'\n(\d+) programs asked for \(\d+ distinct, \d+ asked for again\), [\d.]+ s in XLA', table), table


ZERO_PAIR = '''
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import parity


class Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, kernel_init=nn.initializers.zeros)(x)
    return nn.Dense(1, kernel_init=nn.initializers.zeros)(h)


class Nnx(nnx.Module):
  def __init__(self, rngs):
    self.Dense_0 = nnx.Linear(3, 4, kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.Dense_1 = nnx.Linear(4, 1, kernel_init=nnx.initializers.zeros, rngs=rngs)

  def __call__(self, x):
    return self.Dense_1(self.Dense_0(x))


def batch(step, split='train'):
  rng = np.random.default_rng(step)
  return {'x': rng.standard_normal((8, 3)).astype(np.float32), 'y': rng.standard_normal((8, 1)).astype(np.float32)}


zeros = parity.model_pair('zeros', linen=Linen(), nnx=Nnx, inputs=lambda b: b['x'],
                          loss=lambda y, b: jnp.mean((y - b['y']) ** 2), optimizer=optax.sgd(0.1), batch=batch,
                          mode=None, dropout=None, parts=('grads',))
'''


def test_what_a_passing_part_did_not_prove_is_printed_at_the_end_of_the_run(pytester):
  """A pair whose first layer gets exactly zero gradient (both kernels zero) passes its grads part; the run
  ends with a section naming what the numbers did not prove, under xdist too (the note is not
  left in the JUnit XML alone)."""
  pytester.makepyfile(test_zeros=ZERO_PAIR)
  for extra in ((), ('-n', '2')):
    result = pytester.runpytest_subprocess('-p', 'no:cacheprovider', *extra)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        '*parity: passed, but not proven by values*',
        '*test_zeros.py::zeros::test_grads: not proven by values: 3 parameter(s) whose gradient is exactly zero'
        ' on both sides*(params/Dense_0/bias, params/Dense_0/kernel, params/Dense_1/kernel)',
    ])
