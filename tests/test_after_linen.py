"""After Linen: a record of the Linen side keeps proving the NNX side once the Linen code is gone.

The language-model pair and the production-shaped pair are recorded (`parity.record`), then
declared again with `parity.recorded(DIR)` for their Linen side, the Linen model modules made
unimportable, and the recorded battery runs part by part against the NNX side. It passes; with
the NNX side broken three ways (a norm's epsilon, its dropout keys, a sharding rule) it fails,
naming the leaf and the step; a record from another environment, or a file of it missing or
corrupt, is refused by name. Each record is taken in its pair's xdist group, from the runs that
pair's battery computed already.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import sys
from typing import Sequence

import pytest

import parity
from parity.battery.parts import ONE_DEVICE
from parity.records import checks as recorded_checks
from parity.records import files as record_files
from models import families
from models.families import LM_RULES, PROD_RULES, lm_batch, prod_batch, prod_mesh
from models.nnx import lm as nnx_lm
from models.nnx import prod as nnx_prod
import tests.test_family_lm_model_level as lm_pairs
import tests.test_family_production as prod_pairs

LM_MESH = lm_pairs.lm_model_level.meshes[0]
PROD_MESH = prod_pairs.production.meshes[0]


def _lm_after_linen(record_dir, make=None, **nnx_options) -> parity.Pair:
  """The language-model pair as its team declares it once Linen is deleted: the NNX side's own
  model, loss and optimizer, the record for the Linen side."""
  cfg = lm_pairs.CFG
  return parity.model_pair(
      'lm_after_linen', linen=parity.recorded(record_dir),
      nnx=make or (lambda rngs: nnx_lm.LanguageModel(cfg, rngs=rngs)),
      inputs=lambda b: b['tokens'][:, :-1], loss=lambda logits, b: nnx_lm.next_token_loss(logits, b['tokens']),
      optimizer=nnx_lm.make_optimizer(cfg), batch=lambda step, split: lm_batch(cfg, step, split), rules=LM_RULES,
      meshes=(LM_MESH,), decode=parity.Decode(prompt=lambda b: b['tokens'][:, :4]),
      known_differences=(lm_pairs.LN,), nnx_options=nnx_options or None)


def _production_after_linen(record_dir, **nnx_options) -> parity.Pair:
  baseline = parity.recorded(record_dir)
  cfg = prod_pairs.CFG

  def make_sides(mesh):
    options = dict(forward=nnx_prod.forward, dropout_keys='linen', mesh=mesh, rules=PROD_RULES, **nnx_options)
    return baseline.side(mesh), parity.StockNnx(functools.partial(nnx_prod.create_train_state, cfg),
                                                nnx_prod.train_step, nnx_prod.eval_step, nnx_prod.loss_fn, **options)

  return parity.Pair('production_after_linen', make_sides, functools.partial(prod_batch, cfg),
                     mesh_factory=prod_mesh, meshes=(PROD_MESH,))


def _parts(pair: parity.Pair) -> list[tuple[str, dict]]:
  """Every test the plugin generates for `pair`, as (part, its parameters)."""
  out = [('structure', {}), ('specs', {}), ('init', {}), ('grads', {}),
         ('train', {'init_side': 'linen'}), ('train', {'init_side': 'nnx'}), ('eval', {})]
  out += [('checkpoints', {'direction': d}) for d in parity.DIRECTIONS]
  out += [(part, {'direction': d}) for part in ('resume', 'convert') for d in ('linen->nnx', 'nnx->linen')]
  out += [('mesh', {'parity_mesh': m}) for m in pair.meshes]
  out += [('memory', {}), ('program', {}), ('localize', {})]
  if pair.decode is not None:
    out += [('decode', {'decode_placement': p}) for p in (ONE_DEVICE, *pair.meshes)]
  return out


def _without_linen(monkeypatch, *modules: str) -> None:
  """The Linen model modules made unimportable (an import of one raises ImportError)."""
  for module in modules:
    monkeypatch.setitem(sys.modules, module, None)
  with pytest.raises(ImportError):
    __import__(modules[0])


@pytest.fixture(scope='module')
def lm_record(tmp_path_factory):
  return parity.record(lm_pairs.lm_model_level, tmp_path_factory.mktemp('records') / 'lm', progress=None)


@pytest.fixture(scope='module')
def production_record(tmp_path_factory):
  return parity.record(prod_pairs.production, tmp_path_factory.mktemp('records') / 'production', progress=None)


def _run_battery(pair: parity.Pair, parts: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
  """Every part (of `parts`) against the record: (failures, the parts not checked and why)."""
  failures, unchecked = [], []
  for part, params in _parts(pair):
    if parts is not None and part not in parts:
      continue
    try:
      recorded_checks.check(pair, part, **params)
    except recorded_checks.NotCheckable as e:
      unchecked.append(f'{part} {params}: {e}')
    except AssertionError as e:
      failures.append(f'{part} {params}: {e}')
  return failures, unchecked


@pytest.mark.xdist_group('parity-lm_model_level')
def test_the_language_model_pair_passes_against_its_record_with_linen_gone(lm_record, monkeypatch):
  _without_linen(monkeypatch, 'models.linen.lm')
  failures, unchecked = _run_battery(_lm_after_linen(lm_record.directory))
  assert not failures, '\n'.join(failures)
  # The parts that need Linen alive say so, each: none passes unchecked.
  assert sorted({line.split(' ', 1)[0] for line in unchecked}) == ['checkpoints', 'convert', 'localize', 'resume']
  assert not any("'nnx->nnx'" in line for line in unchecked), unchecked  # the NNX side's own round trip: checked
  assert all('is not checked against the record' in line for line in unchecked), unchecked


# What the production pair proves beyond the language model's replay (which runs every part in the
# core tier): its activation constraints recorded, Linen's dropout draws through nn.scan and the ToLinen
# wrapper taken from the record, its memory with state only NNX keeps. The rest is the exhaustive tier's.
PRODUCTION_CORE_PARTS = ('structure', 'specs', 'train', 'memory')


@pytest.mark.xdist_group('parity-production')
@pytest.mark.parametrize('parts', [
    pytest.param(PRODUCTION_CORE_PARTS, id='core-parts'),
    pytest.param(None, id='every-part', marks=pytest.mark.exhaustive),
])
def test_the_production_pair_passes_against_its_record_with_linen_gone(production_record, monkeypatch, parts):
  _without_linen(monkeypatch, 'models.linen.prod', 'models.linen.nnx_wrappers')
  pair = _production_after_linen(production_record.directory)
  failures, unchecked = _run_battery(pair, parts)
  assert not failures, '\n'.join(failures)
  if parts is None:
    assert unchecked  # the parts that need Linen alive, each with its reason


@pytest.mark.xdist_group('parity-lm_model_level')
def test_a_norm_epsilon_changed_fails_naming_the_step_and_leaf(lm_record):
  def make(rngs):
    model = nnx_lm.LanguageModel(lm_pairs.CFG, rngs=rngs)
    model.final_norm.epsilon = 1e-3  # flax's default 1e-6 on both sides until now
    return model

  pair = _lm_after_linen(lm_record.directory, make=make)
  with pytest.raises(AssertionError) as e:
    recorded_checks.check(pair, 'train', init_side='linen')
  message = str(e.value)
  assert 'train (from=linen) differs from the record' in message and 'first: step 0 loss' in message, message
  # Then each leaf of the final state that differs, by its path, with both digests.
  assert re.search(r'\n  final params/\S+: recorded float32\[\d', message) or 'final opt_state/0/mu/' in message, message
  # The program part names the constant, and where the whole live program is written to diff.
  with pytest.raises(AssertionError) as e:
    recorded_checks.check(pair, 'program')
  live = re.search(r'the recorded and the live one: diff (\S+) (\S+)$', str(e.value), re.M)
  assert live and live.group(1).endswith('program.txt') and open(live.group(2)).read().startswith('module'), str(e.value)


@pytest.mark.xdist_group('parity-lm_model_level')
def test_dropout_keys_of_its_own_fail_naming_the_step(lm_record):
  pair = _lm_after_linen(lm_record.directory, dropout_keys='nnx')  # the NNX side's own keys, not Linen's
  with pytest.raises(AssertionError) as e:
    recorded_checks.check(pair, 'train', init_side='linen')
  assert 'first: step 0 loss' in str(e.value), str(e.value)


@pytest.mark.xdist_group('parity-lm_model_level')
def test_a_sharding_rule_changed_fails_naming_the_leaf(lm_record, monkeypatch):
  monkeypatch.setitem(families.LM_MESH_AXES, 'mlp', None)  # the NNX model's MLP kernels replicated
  pair = _lm_after_linen(lm_record.directory)
  with pytest.raises(AssertionError, match=r'DecoderBlock_0/MlpBlock_0/Dense_0/kernel') as e:
    recorded_checks.check(pair, 'specs')
  with pytest.raises(AssertionError) as e:
    recorded_checks.check(pair, 'mesh', parity_mesh=LM_MESH)
  message = str(e.value)
  assert f'mesh ({LM_MESH}) differs from the record' in message, message
  # Placement first, as the mesh part checks it: an MLP kernel placed otherwise is the cause.
  assert re.search(r'first: placed \S+/MlpBlock_0/Dense_[01]/kernel: recorded float32\[\d+, \d+\] ', message), message


@pytest.mark.xdist_group('parity-lm_model_level')
@pytest.mark.parametrize('field, value, named', [
    ('jax', '0.0.1', "jax: recorded '0.0.1'"),
    ('xla_flags', ['--xla_cpu_enable_fast_math=true'], 'xla_flags: recorded with --xla_cpu_enable_fast_math=true, here nothing more'),
])
def test_a_record_from_another_environment_is_refused_naming_the_difference(lm_record, tmp_path, field, value, named):
  copy = tmp_path / 'lm'
  shutil.copytree(lm_record.directory, copy)
  manifest = json.loads((copy / record_files.MANIFEST).read_text())
  env = manifest['environment']
  env[field] = env[field] + value if isinstance(value, list) else value  # a flag more, or another version
  (copy / record_files.MANIFEST).write_text(json.dumps(manifest))
  pair = _lm_after_linen(copy)
  with pytest.raises(AssertionError, match='taken in another environment') as e:
    recorded_checks.check(pair, 'train', init_side='linen')
  assert named in str(e.value) and 'parity record --pair' in str(e.value), str(e.value)
  recorded_checks.check(pair, 'structure')  # shapes and specs do not depend on it


@pytest.mark.xdist_group('parity-lm_model_level')
def test_a_record_file_missing_or_corrupt_is_named(lm_record, tmp_path):
  copy = tmp_path / 'lm'
  shutil.copytree(lm_record.directory, copy)
  (copy / 'train.txt').write_text((copy / 'train.txt').read_text().replace('\t', ' ', 1))
  (copy / record_files.START).unlink()
  pair = _lm_after_linen(copy)
  with pytest.raises(record_files.RecordError, match=r'start\.npz is missing'):
    recorded_checks.check(pair, 'train', init_side='linen')
  with pytest.raises(record_files.RecordError, match=r'train\.txt: line 2 is not'):
    copy.joinpath('start.npz').write_bytes(lm_record.directory.joinpath('start.npz').read_bytes())
    recorded_checks.check(_lm_after_linen(copy), 'train', init_side='linen')
  with pytest.raises(record_files.RecordError, match='no such directory'):
    recorded_checks.check(_lm_after_linen(tmp_path / 'nowhere'), 'structure')


def test_a_pair_with_a_value_bound_is_not_recorded(tmp_path):
  bound = parity.KnownDifference(('Dense_0',), ('grads',), 'planted', max_ulp=2, substitute=lambda mesh: None)
  pair = dataclasses.replace(lm_pairs.lm_model_level, known_differences=(bound,))
  with pytest.raises(ValueError, match='a record keeps digests'):
    parity.record(pair, tmp_path / 'r', progress=None)
  assert not (tmp_path / 'r').exists()


@pytest.mark.exhaustive
def test_a_record_of_the_default_preset_is_under_a_mebibyte_and_replays(tmp_path):
  """The reference decoder's `default` preset (1.1 B parameters) recorded from its shapes alone
  (structure, specs, the train step's program and memory: nothing initialised or run), under
  1 MiB; the NNX side, alone, then passes those parts against it."""
  from bridge.sides import RULES, NnxSide, make_sides
  from models import data
  from models.config import get_configs

  cfgs = get_configs('default', '01_baseline')
  parts = ('structure', 'specs', 'program', 'memory')
  pair = parity.Pair('decoder_default', lambda mesh: make_sides(*cfgs, mesh),
                     lambda step, split='train': data.make_batch(*cfgs, step=step, split=split), parts=parts)
  record = parity.record(pair, tmp_path / 'default', progress=None)
  assert record.manifest['abstract'] and not (record.directory / record_files.START).exists()
  assert record_files.size(record.directory) < 1 << 20, record_files.size(record.directory)
  baseline = parity.recorded(record.directory)
  after = parity.Pair('decoder_default_after_linen', lambda mesh: (baseline.side(mesh), NnxSide(*cfgs, mesh, tuple(RULES))),
                      pair.batch, parts=parts)
  for part in parts:
    recorded_checks.check(after, part)


@pytest.mark.xdist_group('parity-lm_model_level')
def test_a_linen_checkpoint_converts_to_nnx_with_only_the_record_and_the_nnx_side(lm_record, tmp_path, monkeypatch):
  """A checkpoint the Linen code saved before it was deleted is read by the record's layout of it and
  converted through the NNX side alone: the same NNX checkpoint as the live pair converts it to."""
  import orbax.checkpoint as ocp

  from parity.battery.checks import shared
  from parity.store.pair_convert.atomic import ConvertError

  # A trained state (every leaf its own numbers, unlike a fresh norm's ones and zeros), as the
  # Linen training code's own save of its TrainState writes it.
  *_, trained = shared._runs(lm_pairs.lm_model_level).trajectory('linen', 'linen')
  saver = ocp.StandardCheckpointer()
  saver.save(tmp_path / 'linen', trained)
  saver.wait_until_finished()
  expected = parity.convert_checkpoint(lm_pairs.lm_model_level, tmp_path / 'linen', tmp_path / 'expected', 'nnx')
  _without_linen(monkeypatch, 'models.linen.lm')
  after = _lm_after_linen(lm_record.directory)
  result = parity.convert_checkpoint(after, tmp_path / 'linen', tmp_path / 'nnx', 'nnx')
  assert (result.source_format, result.target_format) == (expected.source_format, 'nnx'), result
  diff = parity.compare_checkpoints(after, tmp_path / 'expected', tmp_path / 'nnx')
  assert diff.equal and diff.compared == len(lm_record.table('structure')['checkpoint layout']), diff
  with pytest.raises(ConvertError, match='needs the Linen side alive'):
    parity.convert_checkpoint(after, tmp_path / 'nnx', tmp_path / 'back', 'linen')
  with pytest.raises(ConvertError, match='--verify, which restores and trains both sides'):
    parity.convert_checkpoint(after, tmp_path / 'linen', tmp_path / 'verified', 'nnx', verify=True)


@pytest.mark.xdist_group('parity-lm_model_level')
def test_an_initialiser_of_another_scale_fails_the_init_part_naming_the_leaf(lm_record):
  """The init part against the recorded Linen init: a kernel drawn at twice the scale is another
  distribution, named by its leaf (the record keeps each random leaf's count, mean and std)."""
  def make(rngs):
    model = nnx_lm.LanguageModel(lm_pairs.CFG, rngs=rngs)
    kernel = model.blocks[0].mlp.linear1.kernel
    kernel[...] = kernel[...] * 2
    return model

  with pytest.raises(AssertionError, match=r'init params/DecoderBlock_0/MlpBlock_0/Dense_0/kernel: another distribution'):
    recorded_checks.check(_lm_after_linen(lm_record.directory, make=make), 'init')
