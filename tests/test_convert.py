"""`parity convert`: layouts that differ, converted and back bit for bit; bad input.

The source is a tiny Linen checkpoint whose every array holds random bit
patterns (NaN payloads, -0.0, subnormals), so a conversion that touches a
value anywhere (a cast, a copy through float arithmetic) fails. Converted
NNX checkpoints are read back with Orbax and compared with the NNX side's own
state: the tree `nnx.state((model, optimizer))` has, with that layout.

Every bad input is refused with exit status 2 and a one-line message on
stderr (a tree mismatch lists each path on a line of its own), and leaves
nothing behind: no DST, no temporary directory, SRC unchanged. A conversion
killed mid-way is tested in a subprocess, paused inside the conversion and
sent SIGTERM (it cleans up and exits 2) or SIGKILL (no DST; the next
conversion to that DST removes the leftover temporary directory). Smaller
cases (NNX trees to classify or refuse, the swap of `--overwrite` cut off, a
write that fails) use tiny checkpoints written with the converter's writer.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import tensorstore as ts

from parity.core import paths
from bridge import train_state
from models import rng
from models.config import get_configs, replace
from parity.store import checkpoints as ck
from parity.run import cli
from parity.store import convert
from parity.core.bitwise import assert_bitwise_equal
from bridge.sides import make_sides

pytestmark = pytest.mark.xdist_group('convert')

STEP = 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _random_bits(abstract, seed: int) -> dict[str, np.ndarray]:
  gen = np.random.default_rng(seed)
  out = {}
  for path, leaf in abstract.items():
    dtype = np.dtype(leaf.dtype)
    if path == 'step':
      out[path] = np.asarray(STEP, dtype)
    else:
      bits = gen.integers(0, 2 ** (8 * dtype.itemsize), size=leaf.shape, dtype=f'u{dtype.itemsize}')
      out[path] = bits.view(dtype)
  return out


def _fingerprint(root: str) -> dict[str, tuple[int, int, str]]:
  """Every file under `root`: size, mtime and content hash."""
  out = {}
  for parent, _, files in os.walk(root):
    for name in files:
      path = os.path.join(parent, name)
      with open(path, 'rb') as f:
        digest = hashlib.sha1(f.read()).hexdigest()
      stat = os.stat(path)
      out[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns, digest)
  return out


@dataclasses.dataclass
class Source:
  dir: str
  flat: dict[str, np.ndarray]
  key: jax.Array
  fingerprint: dict[str, tuple[int, int, str]]

  def assert_intact(self) -> None:
    assert _fingerprint(self.dir) == self.fingerprint, 'SRC was modified'


@pytest.fixture(scope='module')
def sides():
  return {
      scenario: dict(zip(('linen', 'nnx'), make_sides(*get_configs('tiny', scenario))))
      for scenario in ('01_baseline', '10_scan_axis0', '02_unscanned')
  }


@pytest.fixture(scope='module')
def source(tmp_path_factory, sides) -> Source:
  linen = sides['01_baseline']['linen']
  flat = _random_bits(linen.abstract_checkpoint(), seed=3)
  key = rng.base_key(5)
  directory = str(tmp_path_factory.mktemp('convert') / 'src')
  manager = ck.open_manager(directory)
  ck.save(manager, STEP, linen, linen.from_checkpoint(flat), key)
  manager.close()
  return Source(directory, flat, key, _fingerprint(directory))


def _read(directory) -> dict[str, dict[str, jax.Array]]:
  manager = ck.open_manager(directory, create=False)
  try:
    return ck.restore_arrays(manager, STEP)
  finally:
    manager.close()


def _unscanned(nnx_flat, scan_axis: int = 1) -> dict[str, np.ndarray]:
  out = {}
  for path, x in nnx_flat.items():
    if '/decoder/layers/' in path:
      for i in range(x.shape[scan_axis]):
        out[path.replace('/decoder/layers/', f'/decoder/layers_{i}/')] = np.take(np.asarray(x), i, scan_axis)
    else:
      out[path] = x
  return out


def _expected_nnx(layout: str, source: Source, sides) -> dict[str, jax.Array]:
  """The NNX side's own state tree, with that layout, holding the source's values."""
  scenario = {'same': '01_baseline', 'scan_axis0': '10_scan_axis0', 'unscanned': '01_baseline'}[layout]
  nnx_side = sides[scenario]['nnx']
  expected = paths.flatten(nnx_side.from_checkpoint(source.flat))
  if layout == 'unscanned':
    expected = _unscanned(expected)
    # ... which is exactly the tree of an unscanned NNX model.
    paths.check_leaves('unscanned NNX state', paths.flatten(sides['02_unscanned']['nnx'].template), expected)
  return expected


CASES = {
    'same': ['--layout', 'same'],
    # The layout comes from the scenario, and SRC is checked against it.
    'scan_axis0': ['--preset', 'tiny', '--scenario', '10_scan_axis0'],
    'unscanned': ['--layout', 'unscanned'],
}


@pytest.mark.parametrize('layout', sorted(CASES))
def test_convert_to_nnx_and_back_is_bitwise(source, sides, tmp_path, capsys, layout):
  nnx_dir, back_dir = str(tmp_path / 'nnx'), str(tmp_path / 'back')
  assert cli.main(['convert', source.dir, nnx_dir, '--to', 'nnx', *CASES[layout]]) == 0
  assert re.match(rf'converted step {STEP} to the nnx layout \({layout}\): \d+ arrays', capsys.readouterr().out)
  converted = _read(nnx_dir)
  assert_bitwise_equal(_expected_nnx(layout, source, sides), converted[ck.ITEMS], f'NNX layout {layout}')
  assert_bitwise_equal(source.key, converted[ck.RNG][ck.DROPOUT_BASE], 'dropout key')

  assert cli.main(['convert', nnx_dir, back_dir, '--to', 'linen', *CASES[layout]]) == 0
  assert_bitwise_equal(source.flat, _read(back_dir)[ck.ITEMS], f'{layout} and back')
  source.assert_intact()


@pytest.mark.exhaustive
@pytest.mark.parametrize('layout', ['same', 'scan_axis0'])
def test_fp8_scaling_state_converts_with_the_model(tmp_path, layout):
  """fp8 scales and amax histories: Linen `fp8_meta/...`, NNX model state `0/...`."""
  model_cfg, train_cfg = get_configs('tiny', '05_fp8')
  linen, _ = make_sides(model_cfg, train_cfg)
  nnx_cfg = replace(model_cfg, nnx_param_scan_axis=0) if layout == 'scan_axis0' else model_cfg
  _, nnx_side = make_sides(nnx_cfg, train_cfg)
  flat = _random_bits(linen.abstract_checkpoint(), seed=4)
  assert any(p.startswith('fp8_meta/decoder/layers/') for p in flat)
  src, nnx_dir, back_dir = (str(tmp_path / n) for n in ('src', 'nnx', 'back'))
  manager = ck.open_manager(src)
  ck.save(manager, STEP, linen, linen.from_checkpoint(flat), rng.base_key(0))
  manager.close()
  assert cli.main(['convert', src, nnx_dir, '--to', 'nnx', '--layout', layout]) == 0
  expected = paths.flatten(nnx_side.from_checkpoint(flat))
  assert_bitwise_equal(expected, _read(nnx_dir)[ck.ITEMS], f'fp8 NNX layout {layout}')
  assert cli.main(['convert', nnx_dir, back_dir, '--to', 'linen', '--layout', layout]) == 0
  assert_bitwise_equal(flat, _read(back_dir)[ck.ITEMS], f'fp8 {layout} and back')


def test_fp8_state_names_are_the_models():
  """`--to linen` tells fp8 scaling state by name: the fp8 scenario's `Fp8Meta` variables (and Linen's)."""
  linen, nnx_side = make_sides(*get_configs('tiny', '05_fp8'))
  nnx_names = {p.rsplit('/', 1)[1] for p in train_state._fp8_paths(nnx_side.template)}
  linen_names = {p.rsplit('/', 1)[1] for p in linen.abstract_checkpoint() if p.startswith('fp8_meta/')}
  assert nnx_names == linen_names == set(convert.FP8_META_NAMES)


RULES = """\
# Linen name => NNX name, whole path segments
self_attention => attn
mlp/wi_0 => mlp/gate   # a two-segment rule
"""


def test_rename_rules_apply_to_parameters_and_their_optimizer_state(source, sides, tmp_path):
  rules = tmp_path / 'rules.txt'
  rules.write_text(RULES)
  nnx_dir, back_dir = str(tmp_path / 'nnx'), str(tmp_path / 'back')
  args = ['--layout', 'scan_axis0', '--rules', str(rules)]
  assert cli.main(['convert', source.dir, nnx_dir, '--to', 'nnx', *args]) == 0
  rename = lambda p: p.replace('/self_attention/', '/attn/').replace('/mlp/wi_0/', '/mlp/gate/')
  expected = {rename(p): x for p, x in _expected_nnx('scan_axis0', source, sides).items()}
  assert '1/opt_state/1/0/mu/decoder/layers/attn/query/kernel' in expected
  assert_bitwise_equal(expected, _read(nnx_dir)[ck.ITEMS], 'renamed NNX layout')
  assert cli.main(['convert', nnx_dir, back_dir, '--to', 'linen', *args]) == 0
  assert_bitwise_equal(source.flat, _read(back_dir)[ck.ITEMS], 'renamed and back')


def test_overwrite_replaces_a_non_empty_dst(source, tmp_path, capsys):
  dst = tmp_path / 'dst'
  dst.mkdir()
  (dst / 'old.txt').write_text('old')
  assert cli.main(['convert', source.dir, str(dst), '--to', 'nnx']) == 2
  assert f'DST {dst} is not empty; pass --overwrite to replace it' in capsys.readouterr().err
  assert cli.main(['convert', source.dir, str(dst), '--to', 'nnx', '--overwrite']) == 0
  assert sorted(os.listdir(dst)) == [str(STEP)]
  _assert_no_partials(str(dst))


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_progress_on_a_terminal_counts_arrays_and_bytes(source, tmp_path, monkeypatch):
  terminal = _Terminal()
  monkeypatch.setattr(sys, 'stderr', terminal)
  assert cli.main(['convert', source.dir, str(tmp_path / 'dst'), '--to', 'nnx', '--layout', 'unscanned']) == 0
  total = sum(x.nbytes for x in source.flat.values()) / 2**30
  updates = terminal.getvalue().split('\r')
  assert updates[-1] == f'  66/66 arrays, {total:.2f}/{total:.2f} GiB\n', updates[-3:]


# ------------------------------------------------------------- bad input ---


def _partials(dst: str) -> list[str]:
  parent, name = os.path.split(os.path.abspath(dst))
  return [n for n in os.listdir(parent) if n.startswith(f'.{name}.partial-')]


def _assert_no_partials(dst: str) -> None:
  assert not _partials(dst), f'temporary output left behind: {_partials(dst)}'


def _refused(argv, capsys, dst: str) -> str:
  """Runs `parity` with `argv`; asserts exit 2, one message, nothing written; returns it."""
  assert cli.main(argv) == 2
  captured = capsys.readouterr()
  assert captured.out == ''
  assert captured.err.startswith('parity: error: ')
  assert not os.path.exists(dst), f'{dst} was created'
  _assert_no_partials(dst)
  return captured.err


def _copy_source(source: Source, tmp_path) -> str:
  copy = str(tmp_path / 'src')
  shutil.copytree(source.dir, copy)
  return copy


def _largest_array_file(src: str) -> str:
  files = [
      os.path.join(parent, name)
      for parent, _, names in os.walk(os.path.join(src, str(STEP), ck.ITEMS))
      for name in names if os.sep + 'd' + os.sep in os.path.join(parent, name)
  ]
  return max(files, key=os.path.getsize)


def _truncate(path: str) -> None:
  os.truncate(path, os.path.getsize(path) // 2)


def _overwrite_middle(path: str) -> None:
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.seek(size // 4)
    f.write(np.random.default_rng(0).integers(0, 256, size // 2, dtype=np.uint8).tobytes())


@pytest.mark.parametrize('damage', [_truncate, _overwrite_middle], ids=['truncated', 'corrupted'])
def test_damaged_array_file(source, tmp_path, capsys, damage):
  src = _copy_source(source, tmp_path)
  damage(_largest_array_file(src))
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', src, dst, '--to', 'nnx'], capsys, dst)
  # Which array the damage hits, and so tensorstore's status code, depends on
  # where Orbax put each array in its data files.
  assert re.match(
      rf'parity: error: array (params/params|opt_state)/\S+ in {re.escape(src)}/{STEP}/items cannot'
      rf' be read \(file missing, truncated or corrupted\): [A-Z_]+: ', err
  ), err


def test_src_missing(source, tmp_path, capsys):
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', str(tmp_path / 'nope'), dst, '--to', 'nnx'], capsys, dst)
  assert err == f'parity: error: SRC {tmp_path / "nope"} does not exist\n'


def test_src_not_an_orbax_checkpoint(source, tmp_path, capsys):
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'weights.npy').write_bytes(b'\x93NUMPY')
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', str(src), dst, '--to', 'nnx'], capsys, dst)
  assert err == (
      f'parity: error: SRC {src} is not an Orbax checkpoint directory: no step directories'
      ' (<step>/_CHECKPOINT_METADATA) in it\n'
  )
  step_dir = os.path.join(source.dir, str(STEP))
  err = _refused(['convert', step_dir, dst, '--to', 'nnx'], capsys, dst)
  assert err == (
      f'parity: error: SRC {step_dir} is a single step directory; pass its parent (the'
      f' checkpoint directory) and --step {STEP}\n'
  )


def test_step_missing(source, tmp_path, capsys):
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', source.dir, dst, '--to', 'nnx', '--step', '7'], capsys, dst)
  assert err == f'parity: error: SRC {source.dir} has no step 7; steps there: [{STEP}]\n'
  source.assert_intact()


TREE_MISMATCHES = {
    '09_tied_logits': [
        'params/params/decoder/logits_dense/kernel: extra: expected nothing, got float32[64, 256]',
        'opt_state/1/0/mu/params/decoder/logits_dense/kernel: extra',
        'opt_state/1/0/nu/params/decoder/logits_dense/kernel: extra',
    ],
    '08_bf16_weights': [
        'params/params/decoder/decoder_norm/scale: dtype: expected bfloat16, got float32',
        'opt_state/1/0/nu/params/token_embedder/embedding: dtype: expected bfloat16, got float32',
    ],
}


@pytest.mark.parametrize('to', ['nnx', 'linen'])
@pytest.mark.parametrize('scenario', sorted(TREE_MISMATCHES))
def test_tree_does_not_match_the_config(source, tmp_path, capsys, scenario, to):
  src = source.dir
  if to == 'linen':  # an NNX-layout SRC, checked after conversion to the Linen layout
    src = str(tmp_path / 'nnx')
    assert cli.main(['convert', source.dir, src, '--to', 'nnx']) == 0
    capsys.readouterr()
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', src, dst, '--to', to, '--preset', 'tiny', '--scenario', scenario], capsys, dst)
  lines = err.splitlines()
  assert re.match(rf'parity: error: SRC step {STEP}(, converted to the Linen layout,)? vs the config: \d+ path\(s\) do not match:', lines[0])
  for line in TREE_MISMATCHES[scenario]:
    assert any(l.startswith(f'  {line}') for l in lines[1:]), err


def test_wrong_layout_direction_names_the_paths(source, tmp_path, capsys):
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', source.dir, dst, '--to', 'linen'], capsys, dst)
  assert err.startswith('parity: error: SRC is not in the NNX layout given: ')
  assert '  params/params/decoder/decoder_norm/scale: extra: expected an NNX state path' in err


@pytest.mark.parametrize('rules,message', [
    ('no_such_module => x\n', 'rename rule on line 1 (no_such_module => x) matches no parameter path'),
    ('self_attention -> attn\n', "rules.txt:1: expected 'LINEN => NNX', got 'self_attention -> attn'"),
])
def test_bad_rename_rules(source, tmp_path, capsys, rules, message):
  (tmp_path / 'rules.txt').write_text(rules)
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', source.dir, dst, '--to', 'nnx', '--rules', str(tmp_path / 'rules.txt')], capsys, dst)
  assert message in err


@pytest.fixture
def unwritable_dir(tmp_path):
  """A directory in which nothing can be created, even by root (root ignores modes)."""
  locked = tmp_path / 'locked'
  locked.mkdir()
  locked.chmod(0o555)
  try:
    (locked / 'probe').mkdir()
  except PermissionError:
    yield str(locked)
  else:
    (locked / 'probe').rmdir()
    # Running as root: sysfs refuses new entries to everyone.
    if not os.path.isdir('/sys/kernel'):
      pytest.skip('running as root and no /sys: no directory here is unwritable to root')
    yield '/sys/kernel'
  finally:
    locked.chmod(0o755)


def test_dst_not_writable(source, unwritable_dir, capsys):
  dst = os.path.join(unwritable_dir, 'dst')
  err = _refused(['convert', source.dir, dst, '--to', 'nnx'], capsys, dst)
  assert err.startswith(f'parity: error: DST {dst} is not writable: ')
  source.assert_intact()


_PAUSING_CONVERT = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {repo!r})
    from parity.run import cli
    from parity.store import convert
    read_box, reads = convert._read_box, []
    def pausing_read_box(*args):
      reads.append(1)
      if len(reads) == 10:  # some arrays are written by now
        if {elsewhere!r}:  # the kernel must hand SIGTERM to another thread (tensorstore's)
          signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
        print('paused', flush=True)
        # Short sleeps: the kernel may hand SIGTERM to one of tensorstore's
        # threads, and then only the main thread's next bytecode runs the
        # handler; one long sleep would hold it back for the whole pause.
        for _ in range(1200):
          time.sleep(0.1)
      return read_box(*args)
    convert._read_box = pausing_read_box
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.parametrize(
    'sig,elsewhere', [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGKILL, False)],
    ids=['SIGTERM', 'SIGTERM_to_another_thread', 'SIGKILL'],
)
def test_killed_mid_conversion(source, tmp_path, capsys, sig, elsewhere):
  """Killed while converting: SIGTERM removes the partial output, SIGKILL leaves it to the next run.

  `elsewhere`: SIGTERM reaches another thread than the main one, as the
  kernel may choose (this once failed the test, when its pause was one long
  sleep the handler then waited out).
  """
  dst = str(tmp_path / 'dst')
  child = subprocess.Popen(
      [sys.executable, '-c', _PAUSING_CONVERT.format(repo=REPO, elsewhere=elsewhere), 'convert', source.dir, dst,
       '--to', 'nnx', '--layout', 'unscanned'],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
  )
  try:
    assert child.stdout.readline() == 'paused\n', child.stderr.read()
    assert len(_partials(dst)) == 1  # mid-way: the temporary output exists
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
  finally:
    if child.poll() is None:
      child.kill()
  assert not os.path.exists(dst)
  source.assert_intact()
  if sig == signal.SIGTERM:
    assert child.returncode == 2
    assert err == 'parity: error: interrupted by signal 15; nothing written to DST, SRC untouched\n'
    _assert_no_partials(dst)
  else:
    assert child.returncode == -signal.SIGKILL
    assert len(_partials(dst)) == 1  # nothing could clean up after SIGKILL ...
    assert cli.main(['convert', source.dir, dst, '--to', 'nnx']) == 0  # ... the next run does
    _assert_no_partials(dst)
    assert os.listdir(dst) == [str(STEP)]


@pytest.mark.exhaustive
@pytest.mark.parametrize('scenario,layout', [('08_bf16_weights', 'same'), ('10_scan_axis0', 'scan_axis0')])
def test_a_scenario_without_a_preset_picks_the_layout_and_checks_no_tree(source, tmp_path, capsys, scenario, layout):
  """`--scenario` alone names a layout (any preset's); only `--preset` checks the tree.

  The baseline's float32 source does not match 08_bf16_weights (above), yet
  converts: a checkpoint of another preset must not be held to the tiny one.
  """
  dst = str(tmp_path / 'dst')
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx', '--scenario', scenario]) == 0
  assert f'({layout})' in capsys.readouterr().out


# ------------------------------------------------ small checkpoints by hand ---

F32 = np.float32
LINEN_TREE = {'step': np.int32(STEP), 'params/params/x': np.arange(12, dtype=F32).reshape(3, 4)}


def _write_checkpoint(directory, arrays) -> str:
  """Checkpoint directory `directory` holding step STEP: `arrays` (a chunk each) and a dropout key."""
  step_dir = os.path.join(directory, str(STEP))
  for item, tree in ((ck.ITEMS, arrays), (ck.RNG, {ck.DROPOUT_BASE: np.array([1, 2], np.uint32)})):
    writer = convert.ItemWriter(os.path.join(step_dir, item))
    for path, x in tree.items():
      x = np.asarray(x)
      writer.write(path, x.shape, x.dtype, x.shape, iter([(tuple(slice(0, n) for n in x.shape), x)]))
    writer.finish()
  convert.write_step_metadata(step_dir, [ck.ITEMS, ck.RNG])
  return str(directory)


def _paths(directory) -> list[str]:
  """The train state's paths at step STEP, sorted."""
  arrays, _ = convert.read_item(os.path.join(directory, str(STEP), ck.ITEMS), ts.Context())
  return sorted(arrays)


@pytest.mark.parametrize('nnx_tree,linen_paths', [
    (  # b/kernel is frozen: no optimizer state mirrors it
        {'0/a/kernel': np.ones((2, 2), F32), '0/b/kernel': np.ones((2, 2), F32),
         '0/a/input_scale': np.ones((1,), F32), '0/a/kernel_amax_history': np.ones((4,), F32),
         '1/opt_state/0/mu/a/kernel': np.ones((2, 2), F32), '1/opt_state/0/count': np.int32(1),
         '1/step': np.uint32(STEP)},
        ['fp8_meta/a/input_scale', 'fp8_meta/a/kernel_amax_history', 'opt_state/0/count',
         'opt_state/0/mu/params/a/kernel', 'params/params/a/kernel', 'params/params/b/kernel', 'step'],
    ),
    (  # an optimizer without per-parameter state
        {'0/a/kernel': np.ones((2, 2), F32), '1/opt_state/1/count': np.int32(1), '1/step': np.uint32(STEP)},
        ['opt_state/1/count', 'params/params/a/kernel', 'step'],
    ),
    (  # a trainable parameter named like fp8 state: its optimizer state says it is a parameter
        {'0/a/kernel_scale': np.ones((2,), F32), '1/opt_state/0/mu/a/kernel_scale': np.ones((2,), F32),
         '1/step': np.uint32(STEP)},
        ['opt_state/0/mu/params/a/kernel_scale', 'params/params/a/kernel_scale', 'step'],
    ),
    (  # fp8 state of module b beside a trained parameter of a/b of that name: its moments are a/b's
        {'0/a/b/kernel_scale': np.ones((2,), F32), '0/b/kernel_scale': np.ones((1,), F32),
         '1/opt_state/0/mu/a/b/kernel_scale': np.ones((2,), F32), '1/step': np.uint32(STEP)},
        ['fp8_meta/b/kernel_scale', 'opt_state/0/mu/params/a/b/kernel_scale', 'params/params/a/b/kernel_scale',
         'step'],
    ),
], ids=['frozen_parameter', 'optimizer_with_only_a_count', 'trainable_with_an_fp8_name',
        'fp8_state_named_as_the_end_of_a_trained_path'])
def test_model_leaves_are_parameters_unless_named_as_fp8_state(tmp_path, nnx_tree, linen_paths):
  src, dst = _write_checkpoint(tmp_path / 'nnx', nnx_tree), str(tmp_path / 'linen')
  assert cli.main(['convert', src, dst, '--to', 'linen']) == 0
  assert _paths(dst) == linen_paths


@pytest.mark.parametrize('linen_tree,got', [
    ({'fp8_meta/a/kernel': np.ones((2, 2), F32)}, 'float32[2, 2]'),  # not an fp8 variable's name
    ({'fp8_meta/a/kernel_scale': np.ones((1,), F32),  # an fp8 name, but trained
      'opt_state/0/mu/params/a/kernel_scale': np.ones((1,), F32)}, 'float32[1] with optimizer state'),
], ids=['not_an_fp8_name', 'with_optimizer_state'])
def test_fp8_meta_holds_only_what_converts_back_as_fp8_state(tmp_path, capsys, linen_tree, got):
  """NNX keeps fp8 state with the parameters; converted back, a leaf is fp8 state only by its
  name and the absence of optimizer state, so any other leaf under `fp8_meta/` is refused."""
  path = next(iter(linen_tree))
  src = _write_checkpoint(tmp_path / 'linen', {**LINEN_TREE, **linen_tree})
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', src, dst, '--to', 'nnx'], capsys, dst)
  assert err.startswith('parity: error: SRC is not in the Linen checkpoint layout: 1 path(s) do not match:\n'), err
  assert f'  {path}: fp8_meta: expected fp8 scaling state: named one of input_amax_history,' in err
  assert err.endswith(f'without optimizer state, got {got}\n'), err


def test_unscanned_layout_refuses_layers_still_stacked(tmp_path, capsys):
  """`--layout unscanned` reads `decoder/layers_<i>/...`; a stacked `decoder/layers/...` array is not that."""
  src = _write_checkpoint(tmp_path / 'nnx', {
      '0/decoder/layers/w': np.ones((3, 2, 4), F32),
      '1/opt_state/0/mu/decoder/layers/w': np.ones((3, 2, 4), F32),
      '1/step': np.uint32(STEP),
  })
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', src, dst, '--to', 'linen', '--layout', 'unscanned'], capsys, dst)
  assert err.startswith('parity: error: SRC is not in the NNX layout given: 2 path(s) do not match:\n'), err
  for path in ('0/decoder/layers/w', '1/opt_state/0/mu/decoder/layers/w'):
    assert (f'  {path}: layers: expected one array per layer (decoder/layers_<i>/...),'
            ' got float32[3, 2, 4] with no layer index\n') in err


def test_unscanned_layers_are_as_many_in_every_array(tmp_path, capsys):
  src = _write_checkpoint(tmp_path / 'nnx', {
      '0/decoder/layers_0/a': np.ones((3, 4), F32), '0/decoder/layers_1/a': np.ones((3, 4), F32),
      '0/decoder/layers_0/b': np.ones((3, 4), F32), '1/step': np.uint32(STEP),
  })
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', src, dst, '--to', 'linen', '--layout', 'unscanned'], capsys, dst)
  assert err == (
      'parity: error: SRC is not in the NNX layout given: 1 path(s) do not match:\n'
      '  params/params/decoder/layers/b: layers: expected layers 0..1, got layers [0]\n'
  )


def _dead_pid() -> int:
  child = subprocess.Popen([sys.executable, '-c', ''])
  child.wait()
  return child.pid


def _put_aside(dst: str, pid: int, suffix: str = '-replaced') -> str:
  """The old DST as a swap of `--overwrite` by process `pid` puts it aside (`-replaced`;
  `-removing` once the new DST took its place)."""
  parent, name = os.path.split(dst)
  aside = os.path.join(parent, f'.{name}.partial-{pid}{suffix}')
  os.makedirs(aside)
  with open(os.path.join(aside, 'old.txt'), 'w') as f:
    f.write('old')
  return aside


def test_a_swap_killed_between_its_renames_is_undone(tmp_path, capsys):
  """SIGKILL after `--overwrite` put DST aside, before the new one took its place: the next run puts it back."""
  src, dst = _write_checkpoint(tmp_path / 'src', LINEN_TREE), str(tmp_path / 'dst')
  _put_aside(dst, _dead_pid())
  assert cli.main(['convert', src, dst, '--to', 'nnx']) == 2
  assert f'DST {dst} is not empty; pass --overwrite to replace it' in capsys.readouterr().err
  assert os.listdir(dst) == ['old.txt']
  _assert_no_partials(dst)


def test_an_old_dst_killed_while_being_removed_is_never_put_back(tmp_path, capsys):
  """SIGKILL while the swap removed the old DST (`-removing`, maybe half gone): a later
  conversion to a DST deleted meanwhile writes afresh and removes the leftover."""
  src, dst = _write_checkpoint(tmp_path / 'src', LINEN_TREE), str(tmp_path / 'dst')
  _put_aside(dst, _dead_pid(), '-removing')
  assert cli.main(['convert', src, dst, '--to', 'nnx']) == 0, capsys.readouterr().err
  assert os.listdir(dst) == [str(STEP)]
  _assert_no_partials(dst)


def test_a_swap_killed_after_its_renames_leaves_nothing_behind(tmp_path):
  src, dst = _write_checkpoint(tmp_path / 'src', LINEN_TREE), str(tmp_path / 'dst')
  os.makedirs(dst)
  _put_aside(dst, _dead_pid())
  assert cli.main(['convert', src, dst, '--to', 'nnx', '--overwrite']) == 0
  assert os.listdir(dst) == [str(STEP)]
  _assert_no_partials(dst)


def _source_and_an_old_dst(tmp_path) -> tuple[str, str]:
  """A source checkpoint, and a DST holding `old.txt` for `--overwrite` to replace."""
  src, dst = _write_checkpoint(tmp_path / 'src', LINEN_TREE), str(tmp_path / 'dst')
  os.makedirs(dst)
  with open(os.path.join(dst, 'old.txt'), 'w') as f:
    f.write('old')
  return src, dst


def test_a_failed_swap_keeps_the_old_dst(tmp_path, capsys, monkeypatch):
  src, dst = _source_and_an_old_dst(tmp_path)
  rename = os.rename

  def failing_rename(a, b):
    if re.search(r'\.partial-\d+$', a):  # the new output into DST
      raise OSError(errno.EIO, 'Input/output error')
    rename(a, b)

  monkeypatch.setattr(os, 'rename', failing_rename)
  assert cli.main(['convert', src, dst, '--to', 'nnx', '--overwrite']) == 2
  assert capsys.readouterr().err == (
      'parity: error: moving the conversion into DST failed: [Errno 5] Input/output error;'
      ' nothing written to DST, SRC untouched\n'
  )
  assert os.listdir(dst) == ['old.txt']
  _assert_no_partials(dst)


def test_a_swap_that_cannot_put_the_old_dst_back_says_where_it_is(tmp_path, capsys, monkeypatch):
  """Both renames into DST fail: the message names where the old DST sits, and the next
  conversion to DST, while DST is absent, puts it back."""
  src, dst = _source_and_an_old_dst(tmp_path)
  rename = os.rename

  def failing_rename(a, b):
    if b == dst:  # the new output, then the old DST put back
      raise OSError(errno.EIO, 'Input/output error')
    rename(a, b)

  monkeypatch.setattr(os, 'rename', failing_rename)
  assert cli.main(['convert', src, dst, '--to', 'nnx', '--overwrite']) == 2
  err = capsys.readouterr().err
  [aside] = _partials(dst)
  assert aside.endswith('-replaced')
  assert err == (
      'parity: error: moving the conversion into DST failed: [Errno 5] Input/output error, and putting'
      ' the old DST back failed: [Errno 5] Input/output error; the old DST is at'
      f' {os.path.join(os.path.dirname(dst), aside)}: rename it to DST (the next conversion to DST does'
      ' while DST is absent); SRC untouched\n'
  )
  assert not os.path.exists(dst)
  monkeypatch.setattr(os, 'rename', rename)
  assert cli.main(['convert', src, dst, '--to', 'nnx']) == 2  # not empty: the old DST is back
  assert os.listdir(dst) == ['old.txt']
  _assert_no_partials(dst)


_SIGNALLED_SWAP = textwrap.dedent("""
    import os, shutil, signal, sys
    sys.path.insert(0, {repo!r})
    from parity.run import cli
    when = sys.argv.pop(1)
    rename, rmtree, sent = os.rename, shutil.rmtree, []
    def signal_once():
      if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
    def signalling_rename(a, b):
      rename(a, b)
      if when == 'between_renames' and b.endswith('-replaced'):
        signal_once()
    def signalling_rmtree(path, *args, **kwargs):
      if when == 'removing_the_old_dst' and path.endswith('-removing'):
        signal_once()
      return rmtree(path, *args, **kwargs)
    os.rename, shutil.rmtree = signalling_rename, signalling_rmtree
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.parametrize('when', ['between_renames', 'removing_the_old_dst'])
def test_sigterm_during_the_swap(tmp_path, when):
  """SIGTERM waits for the swap of `--overwrite`; after it, DST holds the conversion, said so."""
  src, dst = _write_checkpoint(tmp_path / 'src', LINEN_TREE), str(tmp_path / 'dst')
  os.makedirs(dst)
  with open(os.path.join(dst, 'old.txt'), 'w') as f:
    f.write('old')
  child = subprocess.run(
      [sys.executable, '-c', _SIGNALLED_SWAP.format(repo=REPO), when, 'convert', src, dst, '--to', 'nnx',
       '--overwrite'],
      capture_output=True, text=True, timeout=120,
  )
  assert (child.returncode, child.stderr) == (2, (
      'parity: error: interrupted by signal 15 after the conversion was moved into place;'
      ' DST holds it, SRC untouched\n'
  ))
  assert os.listdir(dst) == [str(STEP)]
  _assert_no_partials(dst)


def _raise(error):
  def fail(*args, **kwargs):
    raise error
  return fail


@pytest.mark.parametrize('target,error,stage', [
    ((convert.ItemWriter, 'finish'), ValueError('OUT_OF_RANGE: Error writing "0.x/c/0/0": File too large\nmore'),
     'writing the converted arrays failed: OUT_OF_RANGE: Error writing "0.x/c/0/0": File too large'),
    ((shutil, 'copytree'), OSError(errno.ENOSPC, 'No space left on device'),
     'copying item rng failed: [Errno 28] No space left on device'),
    ((os, 'fsync'), OSError(errno.EIO, 'Input/output error'),
     'syncing the conversion to disk failed: [Errno 5] Input/output error'),
], ids=['tensorstore', 'copytree', 'fsync'])
def test_a_write_failure_is_one_line(tmp_path, capsys, monkeypatch, target, error, stage):
  src, dst = _write_checkpoint(tmp_path / 'src', LINEN_TREE), str(tmp_path / 'dst')
  monkeypatch.setattr(*target, _raise(error))
  err = _refused(['convert', src, dst, '--to', 'nnx'], capsys, dst)
  assert err == f'parity: error: {stage}; nothing written to DST, SRC untouched\n'


_SMALL_FILES = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {repo!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    from parity.run import cli
    sys.exit(cli.main(sys.argv[1:]))
""")


def test_a_file_too_large_is_one_line(tmp_path):
  """A real write failure: files are limited to 200 kB (RLIMIT_FSIZE); the output's data file is 2 MiB."""
  w = np.random.default_rng(0).standard_normal((64, 2, 4096)).astype(F32)
  src = _write_checkpoint(tmp_path / 'src', {'step': np.int32(STEP), 'params/params/decoder/layers/w': w})
  dst = str(tmp_path / 'dst')
  child = subprocess.run(
      [sys.executable, '-c', _SMALL_FILES.format(repo=REPO), 'convert', src, dst, '--to', 'nnx',
       '--layout', 'scan_axis0'],
      capture_output=True, text=True, timeout=120,
  )
  assert child.returncode == 2, child.stderr
  assert re.fullmatch(
      r'parity: error: writing the converted arrays failed: \S+: .*File too large.*;'
      r' nothing written to DST, SRC untouched\n', child.stderr
  ), child.stderr
  assert 'tensorstore_spec' not in child.stderr  # a long JSON, left out
  assert not os.path.exists(dst)
  _assert_no_partials(dst)
