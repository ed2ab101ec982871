"""The pytest plugin, run as a user runs it: a pair declared in a fresh test file.

The pair is the classifier family with the NNX side broken on purpose
(another dropout rate), so the generated tests must fail with the bitwise
report and the localizer's finding, and `--parity-parts` must select parts.
"""
from __future__ import annotations

import os

import pytest

pytest_plugins = ['pytester']

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BROKEN_PAIR = '''
import dataclasses, functools
from models.families import classifier_batch
from parity.adapter import Pair
from tests.test_family_classifier import CFG, make_sides

def broken_sides(mesh):
  linen, _ = make_sides(CFG, mesh)
  _, nnx_side = make_sides(dataclasses.replace(CFG, dropout_rate=0.2), mesh)
  return linen, nnx_side

broken = Pair('broken', broken_sides, functools.partial(classifier_batch, CFG))
'''


@pytest.fixture
def user_project(pytester, monkeypatch):
  monkeypatch.setenv('PYTHONPATH', REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  pytester.makepyfile(test_user_pair=BROKEN_PAIR)
  return pytester


def test_a_declared_pair_becomes_the_battery(user_project):
  result = user_project.runpytest_subprocess('--collect-only', '-q', '-p', 'no:cacheprovider')
  ids = [line for line in result.outlines if '::' in line]
  assert [i.split('::', 1)[1] for i in ids] == [
      'broken::test_structure', 'broken::test_specs', 'broken::test_grads',
      'broken::test_train[linen]', 'broken::test_train[nnx]', 'broken::test_eval',
      'broken::test_checkpoints[linen->linen]', 'broken::test_checkpoints[linen->nnx]',
      'broken::test_checkpoints[nnx->linen]', 'broken::test_checkpoints[nnx->nnx]',
      'broken::test_resume[linen->nnx]', 'broken::test_resume[nnx->linen]',
      'broken::test_mesh[data=8]', 'broken::test_memory', 'broken::test_program',
      'broken::test_localize',
  ]


def test_a_broken_pair_fails_with_the_bitwise_report_and_the_localizer(user_project):
  result = user_project.runpytest_subprocess('--parity-parts=structure,grads', '-p', 'no:cacheprovider')
  result.assert_outcomes(passed=1, failed=1)
  result.stdout.fnmatch_lines([
      '*broken: loss and gradients are not bit-identical*',
      '*params/Dense_0/kernel: bits: float32*max ULP distance*',
      '*localizer (step 0, train mode):*',
      '*forward pass: first differs at module Dropout_0*',
  ])


def test_an_unknown_part_is_a_usage_error(user_project):
  result = user_project.runpytest_subprocess('--parity-parts=structure,bogus', '-p', 'no:cacheprovider')
  assert result.ret == pytest.ExitCode.USAGE_ERROR
  result.stderr.fnmatch_lines(['ERROR: --parity-parts: unknown part(s) ?\'bogus\'?; parts: structure, *'])
