"""The `parity` command line, run in-process (no new interpreter per test)."""
import json
import os
import subprocess
import sys
import pathlib
import re
import shlex

import pytest

from parity.core.specs import parse_mesh_spec
from models.config import PRESETS, SCENARIOS
from parity.run import cli
from parity.env import xla_env
from tests import tiers

DESIGN_TABLE = {
    'params/params/decoder/decoder_norm/scale': ([2048], ['norm'], [None]),
    'params/params/decoder/layers/mlp/wi_0/kernel': ([2048, 16, 7168], ['embed', 'layers', 'mlp'], ['fsdp', None, None]),
    'params/params/decoder/layers/mlp/wi_1/kernel': ([2048, 16, 7168], ['embed', 'layers', 'mlp'], ['fsdp', None, None]),
    'params/params/decoder/layers/mlp/wo/kernel': ([7168, 16, 2048], ['mlp', 'layers', 'embed'], [None, None, 'fsdp']),
    'params/params/decoder/layers/post_self_attention_layer_norm/scale': ([2048, 16], ['norm', 'layers'], [None, None]),
    'params/params/decoder/layers/pre_self_attention_layer_norm/scale': ([2048, 16], ['norm', 'layers'], [None, None]),
    'params/params/decoder/layers/self_attention/key/kernel': ([2048, 16, 16, 128], ['embed', 'layers', 'kv_heads', 'kv_head_dim'], ['fsdp', None, None, None]),
    'params/params/decoder/layers/self_attention/out/kernel': ([16, 16, 128, 2048], ['heads', 'layers', 'kv', 'embed'], [None, None, None, 'fsdp']),
    'params/params/decoder/layers/self_attention/query/kernel': ([2048, 16, 16, 128], ['embed', 'layers', 'q_heads', 'kv'], ['fsdp', None, None, None]),
    'params/params/decoder/layers/self_attention/value/kernel': ([2048, 16, 16, 128], ['embed', 'layers', 'kv_heads', 'kv_head_dim'], ['fsdp', None, None, None]),
    'params/params/decoder/logits_dense/kernel': ([2048, 32000], ['embed_vocab', 'vocab'], ['fsdp', None]),
    'params/params/token_embedder/embedding': ([32000, 2048], ['vocab', 'embed_vocab'], [None, 'fsdp']),
}


def test_specs_json_reproduces_the_design_table(capsys):
  assert cli.main(['specs', '--preset', 'default', '--mesh', 'fsdp=8', '--format', 'json']) == 0
  out = json.loads(capsys.readouterr().out)
  assert out['param_count'] == 1_104_218_112
  assert out['equal'] is True
  for side in ('linen', 'nnx'):
    got = {r['path']: (r['shape'], r['logical'], r['physical']) for r in out[side]}
    assert got == DESIGN_TABLE
    assert {r['dtype'] for r in out[side]} == {'float32'}


def test_specs_activations_json_matches_the_golden_and_the_seed_logs(capsys):
  from parity.compare import activations
  from tests.golden import GOLDEN_DIR

  args = ['specs', '--activations', '--preset', 'default', '--mesh', 'fsdp=8']
  assert cli.main(args + ['--format', 'json']) == 0
  out = json.loads(capsys.readouterr().out)
  assert out['equal'] is True and out['differences'] == []
  golden = (GOLDEN_DIR / 'default_activation_specs_fsdp8.txt').read_text()
  for side in ('linen', 'nnx'):
    assert activations.format_table(out[side]) == golden
  names = {tuple(r['logical']) for r in out['linen']}
  # The reference decoder's activation names.
  assert ('activation_batch', 'activation_norm_length', 'activation_embed') in names
  assert ('activation_kv_batch', 'activation_attn_length', 'activation_kv_heads',
          'activation_kv_head_dim') in names
  assert ('activation_batch', 'activation_length', 'activation_mlp') in names
  assert cli.main(args) == 0
  assert capsys.readouterr().out.endswith('activation specs equal on both sides\n')


SIDE_KEYS = ('losses', 'loss_hex', 'step_times', 'compile_s', 'checkpoint_s', 'avg_step_s',
             'tokens_per_s', 'tflops_per_s', 'memory')


@pytest.mark.xdist_group('01_baseline')  # the scenario's programs, compiled once in its worker
def test_compare_reports_bit_identical(capsys, tmp_path):
  files = {'json': tmp_path / 'report.json', 'markdown': tmp_path / 'report.md',
           'plot': tmp_path / 'losses.png'}
  argv = ['compare', '--steps', '3', '--checkpoint-every', '2']
  for option, path in files.items():
    argv += [f'--{option}', str(path)]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert 'Diff (NNX − Linen)' in out and 'equal bits' in out
  assert 'verdict: bit-identical' in out
  data = json.loads(files['json'].read_text())
  assert data['bitwise_equal'] is True
  assert data['xla_flags'] == os.environ['XLA_FLAGS'].split()
  assert set(xla_env.portable_cpu_flags()) <= set(data['xla_flags'])  # the suite's portable numerics
  assert data['first_divergent_step'] is None
  assert isinstance(data['programs_identical'], bool)
  for side in ('linen', 'nnx'):
    assert set(SIDE_KEYS) <= set(data[side])
    assert len(data[side]['step_times']) == 3
    assert len(data[side]['checkpoint_s']) == 1  # after step 1
    assert data[side]['memory']['temp_bytes'] > 0
  assert data['linen']['loss_hex'] == data['nnx']['loss_hex']
  assert data['linen']['losses'] == data['nnx']['losses']
  markdown = files['markdown'].read_text()
  assert '| Metric | Linen | NNX | Diff (NNX − Linen) |' in markdown
  assert '| step | Linen loss | NNX loss | equal bits | Linen s | NNX s |' in markdown
  assert files['plot'].read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.exhaustive
def test_compare_exits_1_and_says_where_the_sides_diverge(capsys, monkeypatch, tmp_path):
  """The NNX side receives a state with the embedding nudged: a real divergence at step 0."""
  from bridge import reference

  class Nudged:
    """The NNX side, receiving the state with its embedding scaled by 1.01."""

    def __init__(self, side):
      self._side = side

    def __getattr__(self, name):
      return getattr(self._side, name)

    def from_checkpoint(self, flat):
      path = 'params/params/token_embedder/embedding'
      return self._side.from_checkpoint({**flat, path: flat[path] * 1.01})

  pair_sides = reference._pair_sides  # what the reference decoder's pair makes its sides with
  monkeypatch.setattr(
      reference, '_pair_sides', lambda *a: (lambda l, n: (l, Nudged(n)))(*pair_sides(*a))
  )
  report = tmp_path / 'report.json'
  assert cli.main(['compare', '--steps', '2', '--json', str(report)]) == 1
  out = capsys.readouterr().out
  assert 'first divergent step: 0' in out
  assert 'verdict: DIVERGED at step 0' in out
  data = json.loads(report.read_text())
  assert data['bitwise_equal'] is False and data['first_divergent_step'] == 0
  assert data['linen']['loss_hex'][0] != data['nnx']['loss_hex'][0]


@pytest.mark.parametrize('argv, message', [
    (['compare', '--preset', 'huge'], "unknown preset 'huge'"),
    (['specs', '--mesh', 'fsdp=3,tensor=x'], 'bad mesh spec'),
    (['compare', '--steps', '0'], '--steps must be at least 1'),
    (['compare', '--scenario', '99_nope'], "unknown scenario '99_nope'"),
    (['compare', '--mesh', 'fsdp=3'], "mesh 'fsdp=3' needs 3 devices, but 8 are available"),
    (['compare', '--mesh', 'fsdp=2,pipe-line=4'], 'bad mesh spec'),
    (['compare', '--checkpoint-every', '-1'], '--checkpoint-every must be 0'),
    (['compare', '--json', '/nonexistent/dir/report.json'], 'does not exist'),
    (['compare', '--init', 'nnx', '--resume-from', '/nonexistent'],
     'with --resume-from both sides restore the checkpoint'),
])
def test_bad_input_exits_2_with_one_message(capsys, argv, message):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err
  assert len(err.strip().splitlines()) == 1


REPO = pathlib.Path(__file__).parent.parent
DOCS = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]


def _doc_commands(path: pathlib.Path) -> list[str]:
  """Every `parity ...` example line in a Markdown file's code blocks (synopses left out)."""
  lines, in_block = [], False
  for line in path.read_text().splitlines():
    if line.startswith('```'):
      in_block = not in_block
    else:
      command = re.sub(r'^(\w+=\S+\s+)*', '', line)  # environment assignments first
      if in_block and command.startswith('parity ') and '[' not in command:
        lines.append(command.split('#', 1)[0].strip())
  return lines


def test_readme_and_docs_have_parity_examples():
  """The examples the next test checks are there: the README's and the docs pages'."""
  assert len(DOCS) > 1, DOCS
  assert _doc_commands(REPO / 'README.md')
  assert sum(len(_doc_commands(path)) for path in DOCS) >= 12


@pytest.mark.parametrize('path', DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_readme_and_docs_parity_commands_parse_with_valid_values(path):
  """The examples in README.md and docs/*.md use options the command has, with values it accepts."""
  for command in _doc_commands(path):
    args = cli.build_parser().parse_args(shlex.split(command)[1:])
    if getattr(args, 'preset', None) is not None:
      assert args.preset in PRESETS, command
    if getattr(args, 'scenario', None) is not None:
      assert args.scenario in SCENARIOS, command
    if getattr(args, 'mesh', None) is not None:
      parse_mesh_spec(args.mesh, num_devices=8)  # raises on a malformed spec


def test_compare_out_of_memory_is_one_line_exit_2(capsys, monkeypatch):
  """An XLA out-of-memory error: one line naming the preset and the bytes asked for, exit 2."""
  from parity.run import runner

  def exhausted(*args, **kwargs):
    raise RuntimeError(
        'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 32.02GiB.\n'
        'BufferAssignment OOM Debugging. ...'
    )

  monkeypatch.setattr(runner, 'compare_pair', exhausted)
  assert cli.main(['compare', '--preset', 'default', '--steps', '1']) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'Traceback' not in err
  assert 'preset default' in err and 'asked for 32.02GiB' in err
  assert '--scenario 04_remat' in err and '--mesh' in err


@pytest.mark.parametrize('option', [['--preset', 'tiny'], ['--scenario', '04_remat']])
def test_compare_of_a_pair_refuses_the_decoders_options(option, capsys):
  """A pair brings its own model and data: a --preset or --scenario would be ignored."""
  pair = 'tests/test_family_classifier.py:classifier'
  assert cli.main(['compare', '--pair', pair, '--steps', '1', *option]) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and "choose the reference decoder's pair" in err


def test_compare_of_a_batch_the_mesh_cannot_split_is_a_usage_error(monkeypatch, capsys):
  """Exit 2 with the side's one-line message, not a traceback from inside jax."""
  from parity.pairs import adapter
  from parity.run import runner

  def unsplittable(*args, **kwargs):
    raise adapter.BatchError("batch entry 'images' (float32[6, 8, 8, 3]) has 6 rows: ...")

  monkeypatch.setattr(runner, 'compare_sides', unsplittable)
  pair = 'tests/test_family_classifier.py:classifier'
  assert cli.main(['compare', '--pair', pair, '--steps', '1']) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and "has 6 rows" in err and 'Traceback' not in err


def test_compare_other_errors_are_not_called_out_of_memory(monkeypatch):
  from parity.run import runner

  def broken(*args, **kwargs):
    raise RuntimeError('INTERNAL: something else')

  monkeypatch.setattr(runner, 'compare_pair', broken)
  with pytest.raises(RuntimeError, match='something else'):
    cli.main(['compare', '--steps', '1'])


@pytest.mark.exhaustive
def test_mesh_on_cpu_gets_its_devices_without_a_device_count(tmp_path):
  """`compare --mesh fsdp=4,tensor=2` in a fresh interpreter whose XLA_FLAGS set no device count.

  The command sets 8 CPU devices itself and says so in one line. (The other
  flags of the suite stay, so its programs come from the compilation cache.)
  """
  count = xla_env.flag_name(xla_env.host_device_count_flag(0))
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=' '.join(
      f for f in xla_env.current_flags() if xla_env.flag_name(f) != count
  ))
  report = tmp_path / 'report.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'parity', 'compare', '--mesh', 'fsdp=4,tensor=2', '--steps', '3',
       '--json', str(report)],
      capture_output=True, text=True, env=env, timeout=600,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert proc.stderr.count('8 CPU devices') == 1, proc.stderr
  data = json.loads(report.read_text())
  assert data['num_devices'] == 8 and data['bitwise_equal'] is True
  assert xla_env.host_device_count_flag(8) in data['xla_flags']


def test_compare_takes_a_declared_pair(tmp_path, capsys):
  """`parity compare --pair`: the runner and report on a user's pair, its declared difference accepted."""
  out = tmp_path / 'pair.json'
  spec = 'tests/test_family_classifier.py:classifier'
  assert cli.main(['compare', '--pair', spec, '--steps', '3', '--json', str(out)]) == 0
  text = capsys.readouterr().out
  assert 'Linen vs NNX: pair classifier, 3 steps' in text
  result = json.loads(out.read_text())
  assert result['bitwise_equal'] and result['same_program']
  assert result['memory_verdict'] == 'equal to the byte'
  assert result['expected_difference'].startswith('declared: BatchNorm_0, BatchNorm_1:')
  assert result['unchanged_params'] == [] and 'Not proven by values' not in text  # every parameter moved


@pytest.mark.exhaustive
def test_compare_of_a_diverging_pair_exits_1(capsys):
  spec = 'tests/test_family_encoder.py:encoder_stock_attention'
  assert cli.main(['compare', '--pair', spec, '--steps', '2']) == 1
  assert 'verdict: DIVERGED' in capsys.readouterr().out  # the step depends on the jax version


def test_compare_of_a_pair_whose_states_differ_exits_1_naming_every_path(monkeypatch, capsys, tmp_path):
  """A rename rule left out: a verdict (the sides are not the same program), each path named,
  before anything is compiled; no traceback, and no report that would look complete."""
  import dataclasses

  from parity.pairs.stock_layout import Renames
  from tests import test_family_classifier as classifier

  def sides(mesh):
    linen, nnx_side = classifier.make_sides(classifier.CFG, mesh)
    rules = tuple(r for r in classifier.RENAMES.rules if r[0] != 'Dense_0')
    return linen, dataclasses.replace(nnx_side, renames=Renames(rules), infer_renames=False)

  monkeypatch.setattr(cli, '_load_pair', lambda spec: dataclasses.replace(classifier.classifier, make_sides=sides))
  report = tmp_path / 'report.json'
  assert cli.main(['compare', '--pair', 'any.py:classifier', '--steps', '2', '--json', str(report)]) == 1
  captured = capsys.readouterr()
  assert 'verdict: STATES DIFFER (nothing trained)' in captured.out
  for path in ('params/Dense_0/kernel: missing', 'params/head/kernel: extra',
               'opt_state/0/trace/Dense_0/bias: missing'):
    assert path in captured.out, captured.out
  assert 'no report written' in captured.err and not report.exists()


@pytest.mark.exhaustive
def test_compare_resuming_a_checkpoint_of_other_state_exits_2_naming_every_path(capsys, tmp_path):
  """A checkpoint whose state is not the sides' (01_baseline's, resumed as 09_tied_logits,
  which has no logits_dense): bad input, each path named, no traceback."""
  from models import rng
  from models.config import get_configs
  from parity.store import checkpoints
  from bridge.sides import make_sides

  side, _ = make_sides(*get_configs('tiny', '01_baseline'))
  manager = checkpoints.open_manager(str(tmp_path))
  checkpoints.save(manager, 1, side, side.init(0), rng.base_key(0))
  manager.wait_until_finished()
  manager.close()
  argv = ['compare', '--scenario', '09_tied_logits', '--resume-from', str(tmp_path), '--steps', '3']
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert f'parity: error: --resume-from {tmp_path}: checkpoint step 1 -> linen train state:' in err, err
  assert 'params/params/decoder/logits_dense/kernel: extra' in err and 'Traceback' not in err


@pytest.mark.parametrize('spec, message', [
    ('nowhere.py:x', 'no file nowhere.py'),
    ('tests/test_family_classifier.py:CFG', "has no Pair named 'CFG'"),
    ('no_colon', 'expected FILE.py:NAME or module:NAME'),
])
def test_a_bad_pair_is_one_clear_error(spec, message, capsys):
  assert cli.main(['compare', '--pair', spec]) == 2
  assert message in capsys.readouterr().err


def test_a_pair_file_defining_a_dataclass_loads(tmp_path):
  """A pair's file is run as a module is imported: a dataclass in it with string annotations
  (a TrainState subclass holding an EMA) resolves them through sys.modules."""
  pair_file = tmp_path / 'my_pair.py'
  pair_file.write_text(
      'from __future__ import annotations\n'
      'import dataclasses\n'
      'from parity.pairs.adapter import Pair\n'
      '@dataclasses.dataclass\n'
      'class State:\n'
      '  ema: int = 0\n'
      'pair = Pair("mine", lambda mesh: None, lambda step, split="train": {})\n'
  )
  assert cli._load_pair(f'{pair_file}:pair').name == 'mine'


@pytest.mark.parametrize('package', [False, True], ids=['beside-it', 'in-a-package'])
def test_a_pair_file_imports_its_sibling_modules_as_under_pytest(package, tmp_path, monkeypatch):
  """A test file importing the user's models from beside it (`from stack_models import ...`),
  or from its package (`from pkg.stack_models import ...`, an `__init__.py` beside it), loads
  under `parity compare` from any working directory, as pytest's default import mode has it."""
  import sys

  monkeypatch.setattr(sys, 'path', list(sys.path))  # what the load adds is undone
  monkeypatch.chdir('/')
  where = tmp_path / 'pkg_for_pair' if package else tmp_path
  where.mkdir(exist_ok=True)
  if package:
    (where / '__init__.py').write_text('')
  name = f'sibling_models_{"pkg" if package else "flat"}'
  (where / f'{name}.py').write_text('NAME = "from a sibling"\n')
  importer = f'from pkg_for_pair.{name} import NAME' if package else f'from {name} import NAME'
  (where / 'test_my_pair.py').write_text(
      f'{importer}\n'
      'from parity.pairs.adapter import Pair\n'
      'pair = Pair(NAME, lambda mesh: None, lambda step, split="train": {})\n'
  )
  for module in (name, f'pkg_for_pair.{name}', 'pkg_for_pair'):
    monkeypatch.delitem(sys.modules, module, raising=False)
  assert cli._load_pair(f'{where / "test_my_pair.py"}:pair').name == 'from a sibling'
  assert sys.path[0] == str(tmp_path)


@pytest.mark.exhaustive  # the CLI end to end (a fresh compile of the decoder's steps): the exhaustive tier
def test_compare_without_the_program_check_says_not_compared(capsys, tmp_path):
  """`--no-program-check`: the numbers and memory are compared, the programs are not."""
  report = tmp_path / 'report.json'
  assert cli.main(['compare', '--steps', '2', '--no-program-check', '--json', str(report)]) == 0
  out = capsys.readouterr().out
  assert 'Train-step program' in out and '- Program: not compared' in out
  assert 'canonicalised' not in out
  data = json.loads(report.read_text())
  assert data['bitwise_equal'] is True
  assert data['programs_identical'] is None and data['program_verdict'] == 'not compared'
  assert data['memory_verdict'] == 'equal to the byte'


def test_compare_of_a_pair_compares_what_its_parts_cover(monkeypatch, capsys, tmp_path):
  """A pair whose parts leave out 'program' and 'memory' (here the classifier without its
  declared batch-norm difference, whose programs do differ): `parity compare` compares
  neither, as the pair's battery does not, and says so."""
  import dataclasses

  from tests import test_family_classifier

  pair = dataclasses.replace(test_family_classifier.classifier, known_differences=(), parts=('grads', 'train'))
  monkeypatch.setattr(cli, '_load_pair', lambda spec: pair)
  out = tmp_path / 'pair.json'
  assert cli.main(['compare', '--pair', 'any.py:classifier', '--steps', '2', '--json', str(out)]) == 0
  result = json.loads(out.read_text())
  assert (result['program_verdict'], result['memory_verdict']) == ('not compared', 'not compared')
  assert result['same_program'] and result['bitwise_equal']


def test_compare_of_a_pair_whose_side_lacks_part_of_the_protocol_is_bad_input(monkeypatch, capsys):
  """One line naming the side and what it lacks, exit 2, no traceback."""
  import dataclasses

  from tests import test_family_classifier as classifier

  class NoSpecs:  # a user's NNX side lacking param_specs
    def __init__(self, side):
      self._side = side

    def __getattr__(self, name):
      if name == 'param_specs':
        raise AttributeError(name)
      return getattr(self._side, name)

  def sides(mesh):
    linen, nnx_side = classifier.make_sides(classifier.CFG, mesh)
    return linen, NoSpecs(nnx_side)

  monkeypatch.setattr(cli, '_load_pair', lambda spec: dataclasses.replace(classifier.classifier, make_sides=sides))
  assert cli.main(['compare', '--pair', 'any.py:classifier', '--steps', '1']) == 2
  err = capsys.readouterr().err
  assert 'parity: error: classifier: the NNX side (NoSpecs) lacks param_specs of parity.pairs.adapter.Side' in err, err
  assert 'Traceback' not in err


def test_compare_of_a_pair_whose_parameter_specs_differ_exits_1_naming_each(monkeypatch, capsys, tmp_path):
  """The encoder's NNX side giving one kernel swapped logical axes: a verdict before anything
  is trained (as the battery's specs part would fail), no report."""
  import dataclasses

  from tests import test_family_encoder as encoder

  class Swapped:
    def __init__(self, side):
      self._side = side

    def __getattr__(self, name):
      return getattr(self._side, name)

    def param_specs(self):
      specs = dict(self._side.param_specs())
      specs['params/layers_0/Dense_0/kernel'] = specs['params/layers_0/Dense_0/kernel'][::-1]
      return specs

  def sides(mesh):
    linen, nnx_side = encoder.make_sides(encoder.CFG, mesh)
    return linen, Swapped(nnx_side)

  monkeypatch.setattr(cli, '_load_pair', lambda spec: dataclasses.replace(encoder.encoder, make_sides=sides))
  report = tmp_path / 'report.json'
  assert cli.main(['compare', '--pair', 'any.py:encoder', '--steps', '1', '--json', str(report)]) == 1
  out, err = capsys.readouterr()
  assert "params/layers_0/Dense_0/kernel: encoder parameters: expected ('embed', 'mlp') (Linen), got ('mlp', 'embed') (NNX)" in out, out
  assert 'verdict: SPECS DIFFER (nothing trained)' in out
  assert 'no report written: the specs differ' in err and not report.exists()


def test_compare_of_a_pair_whose_train_step_returns_no_loss_is_bad_input(monkeypatch, capsys):
  """Checked once, on the compiled step's output structure (not in the timed loop)."""
  import dataclasses

  from models.linen import classifier as linen_classifier
  from tests import test_family_classifier as classifier

  def without_loss(state, batch, dropout_base):
    state, metrics = linen_classifier.train_step(state, batch, dropout_base)
    return state, {k: v for k, v in metrics.items() if k != 'loss'}

  def sides(mesh):
    linen, nnx_side = classifier.make_sides(classifier.CFG, mesh)
    return dataclasses.replace(linen, train_step_fn=without_loss), nnx_side

  monkeypatch.setattr(cli, '_load_pair', lambda spec: dataclasses.replace(classifier.classifier, make_sides=sides))
  assert cli.main(['compare', '--pair', 'any.py:classifier', '--steps', '1', '--no-program-check']) == 2
  err = capsys.readouterr().err
  assert "parity: error: parity compare: the linen side's train_step returned metrics [] without `loss`" in err, err
  assert 'Traceback' not in err


@pytest.mark.parametrize('argv', [
    [], pytest.param(['--pair', 'tests/test_family_lm.py:lm'], marks=pytest.mark.exhaustive),
], ids=['decoder', 'lm_pair'])
@pytest.mark.xdist_group(tiers.TINY_PRESET_GROUP)  # the baseline's train steps and decoding, compiled once
def test_compare_decodes_after_training_and_reports_it(argv, tmp_path, capsys):
  """`--decode N`: both sides decode N tokens from one prompt after training, timed side by
  side; the verdict covers decoding and the JSON carries it under "decode"."""
  report = tmp_path / 'report.json'
  assert cli.main(['compare', '--steps', '2', '--decode', '4', '--json', str(report), *argv]) == 0
  out = capsys.readouterr().out
  assert 'Decode: s/token (of 4)' in out and 'Decoding, bit for bit' in out
  assert 'decoding: 4 tokens, their logits and cache' in out
  decode = json.loads(report.read_text())['decode']
  assert decode['bitwise_equal'] is True and decode['steps'] == 4 and decode['first_differing_step'] is None
  assert set(decode['per_token_s']) == {'linen', 'nnx'}
  assert all(isinstance(v, float) for v in (*decode['per_token_s'].values(), *decode['prefill_s'].values()))
  if not argv:  # the reference decoder's sides lower one decoding step: its memory and program compared
    assert 'Memory (decode step)' in out and 'Decode-step program' in out
    assert decode['same_program'] is True and decode['program']['identical'] is True, decode['program']
    assert decode['memory']['linen']['argument_bytes'] > 0
    assert decode['memory']['linen'] == decode['memory']['nnx'], decode['memory']
  else:  # a stock pair's decode_fn is the user's loop: nothing to lower, and the report says so
    assert decode['program'] is None and 'not compared (a side gives no lower_decode_step)' in out


@pytest.mark.exhaustive  # the CLI end to end in a fresh interpreter, on the mesh
def test_compare_decodes_on_a_mesh_from_the_command_line(tmp_path):
  """`parity compare --decode N --mesh fsdp=4,tensor=2`: the command's sides place the cache by
  its logical axes on both sides (bridge/sides.py RULES); without the cache's rules, NNX's cache
  init read `cache_batch` as a mesh axis and the command crashed."""
  report = tmp_path / 'report.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'parity', 'compare', '--mesh', 'fsdp=4,tensor=2', '--steps', '1',
       '--decode', '1', '--no-program-check', '--json', str(report)],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'), timeout=600,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  data = json.loads(report.read_text())
  assert data['num_devices'] == 8 and data['bitwise_equal'] is True
  decode = data['decode']
  assert decode['bitwise_equal'] is True and decode['steps'] == 1, decode
  assert decode['memory']['linen'] == decode['memory']['nnx'], decode['memory']


@pytest.mark.exhaustive  # a planted difference: a fresh compile of the decoder's steps
def test_compare_decode_fails_on_a_decoding_step_whose_program_differs(monkeypatch, capsys):
  """NNX's decoding step lowered on a cache one slot longer: the tokens still agree, but the
  step's memory and program differ, and `compare --decode` says so and exits 1."""
  from models.nnx import decode as nnx_decode

  lower = nnx_decode.lower_step
  monkeypatch.setattr(nnx_decode, 'lower_step', lambda model, batch, max_len: lower(model, batch, max_len + 1))
  assert cli.main(['compare', '--steps', '1', '--decode', '2']) == 1
  captured = capsys.readouterr()
  rows = {line.split('  ')[0]: line for line in captured.out.splitlines()}
  assert 'differs (NNX argument_bytes +' in rows['Memory (decode step)'], rows['Memory (decode step)']
  assert 'programs differ' in rows['Decode-step program'], rows['Decode-step program']
  assert 'the numbers match but not the program (the decoding step)' in captured.err, captured.err
