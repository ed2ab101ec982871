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
conversion to that DST removes the leftover temporary directory).
"""
from __future__ import annotations

import dataclasses
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

from bridge import paths
from models import rng
from models.config import get_configs, replace
from parity import checkpoints as ck
from parity import cli
from parity.bitwise import assert_bitwise_equal
from parity.sides import make_sides

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
    import sys, time
    sys.path.insert(0, {repo!r})
    from parity import cli, convert
    read_box, reads = convert._read_box, []
    def pausing_read_box(*args):
      reads.append(1)
      if len(reads) == 10:  # some arrays are written by now
        print('paused', flush=True)
        time.sleep(120)
      return read_box(*args)
    convert._read_box = pausing_read_box
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGKILL], ids=['SIGTERM', 'SIGKILL'])
def test_killed_mid_conversion(source, tmp_path, capsys, sig):
  dst = str(tmp_path / 'dst')
  child = subprocess.Popen(
      [sys.executable, '-c', _PAUSING_CONVERT.format(repo=REPO), 'convert', source.dir, dst,
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


@pytest.mark.parametrize('scenario,layout', [('08_bf16_weights', 'same'), ('10_scan_axis0', 'scan_axis0')])
def test_a_scenario_without_a_preset_picks_the_layout_and_checks_no_tree(source, tmp_path, capsys, scenario, layout):
  """`--scenario` alone names a layout (any preset's); only `--preset` checks the tree.

  The baseline's float32 source does not match 08_bf16_weights (above), yet
  converts: a checkpoint of another preset must not be held to the tiny one.
  """
  dst = str(tmp_path / 'dst')
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx', '--scenario', scenario]) == 0
  assert f'({layout})' in capsys.readouterr().out
