"""`parity convert` of the reference decoder's checkpoints (no `--pair`: the reference's pair):
converted and back bit for bit, streamed, all or nothing; bad input.

The one converter (parity/store/pair_convert/) converts every pair's checkpoints; without `--pair`
it converts through the reference decoder's pair (`bridge.reference.pair`, of `--preset` and
`--scenario`), so these tests are its streaming, atomicity and signal tests on a real model.

The source is a tiny Linen checkpoint whose every array holds random bit
patterns (NaN payloads, -0.0, subnormals), so a conversion that touches a
value anywhere (a cast, a copy through float arithmetic) fails. Converted
NNX checkpoints are read back array by array and compared with the NNX
side's own state: `nnx.state((model, optimizer))` as its own save code
writes it (in 10_scan_axis0, layers stacked on axis 0: the converter reads
the axis move off the side's `to_checkpoint`).

Every bad input is refused with exit status 2 and a one-line message on
stderr (a tree mismatch lists each path on a line of its own), and leaves
nothing behind: no DST, no temporary directory, SRC unchanged. A conversion
killed mid-way is tested in a subprocess, paused inside the conversion and
sent SIGTERM (it cleans up and exits 2) or SIGKILL (no DST; the next
conversion to that DST removes the leftover temporary directory). The swap
of `--overwrite` cut off, and writes that fail, are tested on the same source.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
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

import parity
from bridge import reference
from bridge.sides import make_sides
from models import rng
from models.config import get_configs, replace
from parity.core import paths
from parity.core.bitwise import assert_bitwise_equal
from parity.run import cli
from parity.store import checkpoints as ck
from parity.store import pair_convert
from parity.store.pair_convert import streaming

pytestmark = pytest.mark.xdist_group('convert')

STEP = 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ('01_baseline', '10_scan_axis0', '02_unscanned')


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
  return {scenario: dict(zip(('linen', 'nnx'), make_sides(*get_configs('tiny', scenario)))) for scenario in SCENARIOS}


def _save_source(directory: str, linen, seed: int) -> tuple[dict[str, np.ndarray], jax.Array]:
  """A kit checkpoint (parity/store/checkpoints.py) of random bits from the Linen side `linen`."""
  flat = _random_bits(linen.abstract_checkpoint(), seed=seed)
  key = rng.base_key(5)
  manager = ck.open_manager(directory)
  ck.save(manager, STEP, linen, linen.from_checkpoint(flat), key)
  manager.close()
  return flat, key


@pytest.fixture(scope='module')
def sources(tmp_path_factory, sides) -> dict[str, Source]:
  """A Linen checkpoint of each scenario's tiny model."""
  out = {}
  for scenario in SCENARIOS:
    directory = str(tmp_path_factory.mktemp('convert') / 'src')
    flat, key = _save_source(directory, sides[scenario]['linen'], seed=3)
    out[scenario] = Source(directory, flat, key, _fingerprint(directory))
  return out


@pytest.fixture(scope='module')
def source(sources) -> Source:
  return sources['01_baseline']


def _read(directory, item: str = ck.ITEMS) -> dict[str, np.ndarray]:
  """Every array of an item of step STEP, by its path on disk, read as it is stored."""
  item_dir = os.path.join(os.fspath(directory), str(STEP), item)
  _, arrays = pair_convert.read_item(item_dir, 'DST')
  out = {}
  for disk, stored in arrays.items():
    spec = pair_convert._store_spec(item_dir, stored.name, stored.zarr3, stored.ocdbt)
    out[disk] = ts.open(spec, read=True, open=True).result().read().result()
  return out


def _on_disk(side, role: str, fmt: str, checkpoint_flat) -> dict[str, np.ndarray]:
  """A side's state holding `checkpoint_flat` (the pair's checkpoint layout) as its own save code
  writes it in format `fmt`, by path on disk."""
  layout = pair_convert.side_layout(side, role, fmt)
  native = paths.flatten(side.from_checkpoint(checkpoint_flat))
  return {leaf.disk: np.asarray(native[leaf.native]) for leaf in layout.leaves}


LAYOUTS = {  # the old converter's --layout, now each the scenario whose sides store it so
    'same': '01_baseline',
    'scan_axis0': '10_scan_axis0',  # NNX stacks layers on axis 0, Linen on axis 1
    'unscanned': '02_unscanned',  # one array per layer, decoder/layers_<i>/...
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_convert_to_nnx_and_back_is_bitwise(sources, sides, tmp_path, capsys, layout):
  scenario = LAYOUTS[layout]
  source = sources[scenario]
  nnx_dir, back_dir = str(tmp_path / 'nnx'), str(tmp_path / 'back')
  args = [] if scenario == '01_baseline' else ['--scenario', scenario]  # the baseline: the default pair
  assert cli.main(['convert', source.dir, nnx_dir, '--to', 'nnx', *args]) == 0
  assert re.match(rf'converted pair decoder_tiny_{scenario} linen -> nnx \(step {STEP}\): \d+ arrays',
                  capsys.readouterr().out)
  expected = _on_disk(sides[scenario]['nnx'], 'nnx', 'nnx', source.flat)
  if layout == 'scan_axis0':
    assert expected['0/decoder/layers/mlp/wi_0/kernel/value'].shape[0] == 2  # the layer axis first
  assert_bitwise_equal(expected, _read(nnx_dir), f'NNX layout {layout}')
  assert_bitwise_equal(np.asarray(jax.random.key_data(source.key)),
                       _read(nnx_dir, ck.RNG)[ck.DROPOUT_BASE], 'dropout key')

  assert cli.main(['convert', nnx_dir, back_dir, '--to', 'linen', *args]) == 0
  assert_bitwise_equal(source.flat, _read(back_dir), f'{layout} and back')
  source.assert_intact()


def _fp8_pair(nnx_scan_axis: int | None = None) -> parity.Pair:
  """The reference's fp8 scenario as a pair; `nnx_scan_axis`: its NNX side stacking layers there."""
  if nnx_scan_axis is None:
    return reference.pair('tiny', '05_fp8')
  model_cfg, train_cfg = get_configs('tiny', '05_fp8')
  nnx_cfg = replace(model_cfg, nnx_param_scan_axis=nnx_scan_axis)

  def sides(mesh):
    return reference.sides_for(model_cfg, train_cfg, mesh)[0], reference.sides_for(nnx_cfg, train_cfg, mesh)[1]

  return parity.Pair(f'decoder_tiny_05_fp8_nnx_axis{nnx_scan_axis}', sides,
                     functools.partial(reference._pair_batch, model_cfg, train_cfg))


@pytest.mark.exhaustive
@pytest.mark.parametrize('layout', ['same', 'scan_axis0'])
def test_fp8_scaling_state_converts_with_the_model(tmp_path, layout):
  """fp8 scales and amax histories: Linen `fp8_meta/...`, NNX model state `0/...`, through the
  pair's correspondences (in `scan_axis0`, the NNX side stacking layers on axis 0)."""
  pair = _fp8_pair(0 if layout == 'scan_axis0' else None)
  linen, nnx_side = pair_convert.pair_sides(pair)
  src, nnx_dir, back_dir = (str(tmp_path / n) for n in ('src', 'nnx', 'back'))
  flat, _ = _save_source(src, linen, seed=4)
  assert any(p.startswith('fp8_meta/decoder/layers/') for p in flat)
  pair_convert.convert_checkpoint(pair, src, nnx_dir, 'nnx')
  assert_bitwise_equal(_on_disk(nnx_side, 'nnx', 'nnx', flat), _read(nnx_dir), f'fp8 NNX layout {layout}')
  pair_convert.convert_checkpoint(pair, nnx_dir, back_dir, 'linen')
  assert_bitwise_equal(flat, _read(back_dir), f'fp8 {layout} and back')


def test_fp8_state_is_model_state_on_the_nnx_side(tmp_path, capsys):
  """`parity convert --scenario 05_fp8`: every Linen `fp8_meta/` leaf lands in the NNX model's state
  (`0/...`), as the pair's correspondences name it, with no rule of the converter's own."""
  linen, nnx_side = make_sides(*get_configs('tiny', '05_fp8'))
  src, dst = str(tmp_path / 'src'), str(tmp_path / 'nnx')
  flat, _ = _save_source(src, linen, seed=6)
  assert cli.main(['convert', src, dst, '--to', 'nnx', '--scenario', '05_fp8']) == 0, capsys.readouterr().err
  layout = pair_convert.side_layout(nnx_side, 'nnx', 'nnx')
  fp8 = [leaf for leaf in layout.leaves if (leaf.checkpoint or '').startswith('fp8_meta/')]
  assert fp8 and all(leaf.disk.startswith('0/') for leaf in fp8)
  converted = _read(dst)
  for leaf in fp8:
    assert_bitwise_equal(flat[leaf.checkpoint], converted[leaf.disk], leaf.checkpoint)


def test_overwrite_replaces_a_non_empty_dst(source, tmp_path, capsys):
  dst = tmp_path / 'dst'
  dst.mkdir()
  (dst / 'old.txt').write_text('old')
  assert cli.main(['convert', source.dir, str(dst), '--to', 'nnx']) == 2
  assert f'DST {dst} is not empty; pass --overwrite to replace it' in capsys.readouterr().err
  assert cli.main(['convert', source.dir, str(dst), '--to', 'nnx', '--overwrite']) == 0
  assert sorted(os.listdir(dst)) == [str(STEP)]
  _assert_no_partials(str(dst))


def test_overwrite_works_for_any_pair(tmp_path, capsys):
  """`--overwrite` with `--pair`: the tiny pair's own StandardCheckpointer save, converted over an old DST."""
  from tests import checkpoint_pairs as tiny_pairs

  import orbax.checkpoint as ocp

  src, dst = tmp_path / 'linen', tmp_path / 'dst'
  saver = ocp.StandardCheckpointer()
  saver.save(os.fspath(src), tiny_pairs.linen_create(0))
  saver.wait_until_finished()
  dst.mkdir()
  (dst / 'old.txt').write_text('old')
  spec = os.path.join(REPO, 'tests', 'checkpoint_pairs.py') + ':tiny'
  assert cli.main(['convert', '--pair', spec, str(src), str(dst), '--to', 'nnx']) == 2
  assert f'DST {dst} is not empty; pass --overwrite to replace it' in capsys.readouterr().err
  assert cli.main(['convert', '--pair', spec, str(src), str(dst), '--to', 'nnx', '--overwrite']) == 0
  assert 'old.txt' not in os.listdir(dst) and '_METADATA' in os.listdir(dst)
  _assert_no_partials(str(dst))


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_progress_on_a_terminal_counts_arrays_and_bytes(sources, tmp_path, monkeypatch):
  source = sources['10_scan_axis0']  # arrays transposed box by box, and arrays copied
  terminal = _Terminal()
  monkeypatch.setattr(sys, 'stderr', terminal)
  assert cli.main(['convert', source.dir, str(tmp_path / 'dst'), '--to', 'nnx', '--scenario', '10_scan_axis0']) == 0
  total = sum(x.nbytes for x in source.flat.values()) / 2**30
  updates = terminal.getvalue().split('\r')
  count = len(source.flat)
  assert updates[-1] == f'  {count}/{count} arrays, {total:.2f}/{total:.2f} GiB\n', updates[-3:]


def test_a_large_array_is_written_in_boxes_with_its_axes_moved(sources, sides, tmp_path, monkeypatch):
  """Boxes smaller than an array (BOX_BYTES, ALIGNED_CHUNK_BYTES made tiny): each written box is
  read from the source with the axes moved, every chunk exactly once, and the result is the same."""
  source = sources['10_scan_axis0']
  monkeypatch.setattr(streaming, 'ALIGNED_CHUNK_BYTES', 4096)
  monkeypatch.setattr(streaming, 'BOX_BYTES', 4096)
  writes = []
  write = streaming.ItemWriter.write

  def counting_write(self, path, shape, dtype, chunk, boxes, value_metadata=None):
    boxes = list(boxes)
    writes.append((path, tuple(shape), tuple(chunk), len(boxes)))
    return write(self, path, shape, dtype, chunk, iter(boxes), value_metadata)

  monkeypatch.setattr(streaming.ItemWriter, 'write', counting_write)
  dst = str(tmp_path / 'nnx')
  pair_convert.convert_checkpoint(reference.pair('tiny', '10_scan_axis0'), source.dir, dst, 'nnx')
  boxed = [w for w in writes if w[3] > 1]
  assert boxed, writes
  for path, shape, chunk, count in boxed:
    assert np.prod(chunk) * 4 <= 4096, (path, chunk)
    assert count == np.prod([-(-n // c) for n, c in zip(shape, chunk)])
  assert_bitwise_equal(_on_disk(sides['10_scan_axis0']['nnx'], 'nnx', 'nnx', source.flat), _read(dst), 'boxed')


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
      f'parity: error: SRC {src} is not an Orbax checkpoint: neither a StandardCheckpointer directory'
      ' (_METADATA) nor a CheckpointManager directory (<step>/_CHECKPOINT_METADATA)\n'
  )
  step_dir = os.path.join(source.dir, str(STEP))
  err = _refused(['convert', step_dir, dst, '--to', 'nnx'], capsys, dst)
  assert err == (
      f'parity: error: SRC {step_dir} is one step of a CheckpointManager directory; pass its parent'
      f' (and --step {STEP})\n'
  )


def test_step_missing(source, tmp_path, capsys):
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', source.dir, dst, '--to', 'nnx', '--step', '7'], capsys, dst)
  assert err == f'parity: error: SRC {source.dir} has no step 7; steps there: [{STEP}]\n'
  source.assert_intact()


def test_step_chosen(source, tmp_path, capsys):
  """`--step` picks a step of a CheckpointManager SRC holding several (default: the latest)."""
  src = _copy_source(source, tmp_path)
  shutil.copytree(os.path.join(src, str(STEP)), os.path.join(src, str(STEP + 4)))
  for step, argv in ((STEP + 4, []), (STEP, ['--step', str(STEP)])):
    dst = str(tmp_path / f'dst{step}')
    assert cli.main(['convert', src, dst, '--to', 'nnx', *argv]) == 0
    assert f'(step {step})' in capsys.readouterr().out
    assert os.listdir(dst) == [str(step)]


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
NNX_TREE_MISMATCHES = {
    '09_tied_logits': [
        '0/decoder/logits_dense/kernel/value: extra: expected nothing, got float32[64, 256]',
        '1/opt_state/1/0/mu/decoder/logits_dense/kernel/value: extra',
        '1/opt_state/1/0/nu/decoder/logits_dense/kernel/value: extra',
    ],
    '08_bf16_weights': [
        '0/decoder/decoder_norm/scale/value: dtype: expected bfloat16 (checkpoint path'
        ' params/params/decoder/decoder_norm/scale), got float32',
        '1/opt_state/1/0/nu/token_embedder/embedding/value: dtype: expected bfloat16 (checkpoint path'
        ' opt_state/1/0/nu/params/token_embedder/embedding), got float32',
    ],
}


@pytest.mark.parametrize('to', ['nnx', 'linen'])
@pytest.mark.parametrize('scenario', sorted(TREE_MISMATCHES))
def test_tree_does_not_match_the_pair(source, tmp_path, capsys, scenario, to):
  """`--scenario` chooses the reference's pair; a checkpoint of another one is refused, each path named."""
  src = source.dir
  if to == 'linen':  # an NNX SRC (the baseline's), not the scenario's NNX side's
    src = str(tmp_path / 'nnx')
    assert cli.main(['convert', source.dir, src, '--to', 'nnx']) == 0
    capsys.readouterr()
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', src, dst, '--to', to, '--preset', 'tiny', '--scenario', scenario], capsys, dst)
  lines = err.splitlines()
  side = 'linen' if to == 'nnx' else 'nnx'
  assert re.match(rf"parity: error: {re.escape(src)} step {STEP} item 'items' is not a checkpoint of pair"
                  rf" 'decoder_tiny_{scenario}' .*; nearest: the {side} side's '{side}': \d+ path\(s\) do not"
                  ' match:', lines[0]), lines[0]
  for line in (TREE_MISMATCHES if to == 'nnx' else NNX_TREE_MISMATCHES)[scenario]:
    assert any(l.startswith(f'  {line}') for l in lines[1:]), err


def test_wrong_direction_says_so(source, tmp_path, capsys):
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', source.dir, dst, '--to', 'linen'], capsys, dst)
  assert err == (f"parity: error: SRC {source.dir} step {STEP} item 'items' is already the linen side's"
                 ' checkpoint: nothing to convert (--to nnx converts it)\n')


def test_preset_and_scenario_are_the_references_only(source, tmp_path, capsys):
  """`--preset`/`--scenario` choose the reference's pair: refused with `--pair`, as `parity compare` refuses
  them; the removed `--layout` and `--rules` are unknown options (a pair's renames and saves say it now)."""
  dst = str(tmp_path / 'dst')
  spec = os.path.join(REPO, 'tests', 'checkpoint_pairs.py') + ':tiny'
  err = _refused(['convert', '--pair', spec, source.dir, dst, '--to', 'nnx', '--scenario', '10_scan_axis0'],
                 capsys, dst)
  assert err == ("parity: error: --preset and --scenario choose the reference decoder's pair; a --pair"
                 ' brings its own model and data\n')
  for option in ('--layout', '--rules'):
    with pytest.raises(SystemExit) as exit_:
      cli.main(['convert', source.dir, dst, '--to', 'nnx', option, 'x'])
    assert exit_.value.code == 2
    assert f'unrecognized arguments: {option} x' in capsys.readouterr().err
  _assert_no_partials(dst)


MISMATCHED = {  # (the source's scenario, the pair's, a line of the refusal)
    # The unscanned model's one array per layer is not the scanned pair's stacked array, nor the reverse.
    'unscanned_source_scanned_pair': ('02_unscanned', '01_baseline', 'params/params/decoder/layers_0/mlp/wo/kernel: extra'),
    'scanned_source_unscanned_pair': ('01_baseline', '02_unscanned', 'params/params/decoder/layers/mlp/wo/kernel: extra'),
    # fp8 scaling state where the pair keeps none: named, not carried along as a parameter.
    'fp8_state_without_fp8': ('05_fp8', '01_baseline', 'fp8_meta/decoder/layers/mlp/wo/'),
}


@pytest.mark.parametrize('case', list(MISMATCHED))
def test_a_checkpoint_of_another_layout_is_refused_naming_each_path(sources, tmp_path, capsys, case):
  source_scenario, pair_scenario, line = MISMATCHED[case]
  if source_scenario in sources:
    src = sources[source_scenario].dir
  else:
    src = str(tmp_path / 'src')
    _save_source(src, make_sides(*get_configs('tiny', source_scenario))[0], seed=8)
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', src, dst, '--to', 'nnx', '--scenario', pair_scenario], capsys, dst)
  assert f"is not a checkpoint of pair 'decoder_tiny_{pair_scenario}'" in err.splitlines()[0], err
  assert any(l.startswith(f'  {line}') for l in err.splitlines()[1:]), err


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
    from parity.store.pair_convert import streaming
    boxes, calls = streaming._boxes, []
    def pausing_boxes(*args):
      calls.append(1)
      if len(calls) == 10:  # some arrays are written by now
        if {elsewhere!r}:  # the kernel must hand SIGTERM to another thread (tensorstore's)
          signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
        print('paused', flush=True)
        # Short sleeps: the kernel may hand SIGTERM to one of tensorstore's
        # threads, and then only the main thread's next bytecode runs the
        # handler; one long sleep would hold it back for the whole pause.
        for _ in range(1200):
          time.sleep(0.1)
      return boxes(*args)
    streaming._boxes = pausing_boxes
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.parametrize(
    'sig,elsewhere', [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGKILL, False)],
    ids=['SIGTERM', 'SIGTERM_to_another_thread', 'SIGKILL'],
)
def test_killed_mid_conversion(sources, tmp_path, capsys, sig, elsewhere):
  """Killed while converting: SIGTERM removes the partial output, SIGKILL leaves it to the next run.

  `elsewhere`: SIGTERM reaches another thread than the main one, as the
  kernel may choose (this once failed the test, when its pause was one long
  sleep the handler then waited out).
  """
  source = sources['10_scan_axis0']
  dst = str(tmp_path / 'dst')
  child = subprocess.Popen(
      [sys.executable, '-c', _PAUSING_CONVERT.format(repo=REPO, elsewhere=elsewhere), 'convert', source.dir, dst,
       '--to', 'nnx', '--scenario', '10_scan_axis0'],
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
    assert err.endswith('parity: error: interrupted by signal 15; nothing written to DST, SRC untouched\n'), err
    _assert_no_partials(dst)
  else:
    assert child.returncode == -signal.SIGKILL
    assert len(_partials(dst)) == 1  # nothing could clean up after SIGKILL ...
    assert cli.main(['convert', source.dir, dst, '--to', 'nnx', '--scenario', '10_scan_axis0']) == 0  # ... the next run does
    _assert_no_partials(dst)
    assert os.listdir(dst) == [str(STEP)]


@pytest.mark.exhaustive
@pytest.mark.parametrize('scenario', ['08_bf16_weights', '10_scan_axis0'])
def test_a_scenario_chooses_the_references_pair(sides, tmp_path, capsys, scenario):
  """`--scenario` alone: that scenario's pair at the tiny preset (`--preset` names another size); its
  own checkpoint converts, through its own correspondences and layout."""
  linen, _ = make_sides(*get_configs('tiny', scenario))
  src, dst = str(tmp_path / 'src'), str(tmp_path / 'dst')
  _save_source(src, linen, seed=7)
  assert cli.main(['convert', src, dst, '--to', 'nnx', '--scenario', scenario]) == 0
  assert f'converted pair decoder_tiny_{scenario} linen -> nnx' in capsys.readouterr().out


# ------------------------------------------------------ the swap of --overwrite ---


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


def test_a_swap_killed_between_its_renames_is_undone(source, tmp_path, capsys):
  """SIGKILL after `--overwrite` put DST aside, before the new one took its place: the next run puts it back."""
  dst = str(tmp_path / 'dst')
  _put_aside(dst, _dead_pid())
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx']) == 2
  assert f'DST {dst} is not empty; pass --overwrite to replace it' in capsys.readouterr().err
  assert os.listdir(dst) == ['old.txt']
  _assert_no_partials(dst)


def test_an_old_dst_killed_while_being_removed_is_never_put_back(source, tmp_path, capsys):
  """SIGKILL while the swap removed the old DST (`-removing`, maybe half gone): a later
  conversion to a DST deleted meanwhile writes afresh and removes the leftover."""
  dst = str(tmp_path / 'dst')
  _put_aside(dst, _dead_pid(), '-removing')
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx']) == 0, capsys.readouterr().err
  assert os.listdir(dst) == [str(STEP)]
  _assert_no_partials(dst)


def test_a_swap_killed_after_its_renames_leaves_nothing_behind(source, tmp_path):
  dst = str(tmp_path / 'dst')
  os.makedirs(dst)
  _put_aside(dst, _dead_pid())
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx', '--overwrite']) == 0
  assert os.listdir(dst) == [str(STEP)]
  _assert_no_partials(dst)


def _an_old_dst(tmp_path) -> str:
  """A DST holding `old.txt` for `--overwrite` to replace."""
  dst = str(tmp_path / 'dst')
  os.makedirs(dst)
  with open(os.path.join(dst, 'old.txt'), 'w') as f:
    f.write('old')
  return dst


def test_a_failed_swap_keeps_the_old_dst(source, tmp_path, capsys, monkeypatch):
  dst = _an_old_dst(tmp_path)
  rename = os.rename

  def failing_rename(a, b):
    if re.search(r'\.partial-\d+$', a):  # the new output into DST
      raise OSError(errno.EIO, 'Input/output error')
    rename(a, b)

  monkeypatch.setattr(os, 'rename', failing_rename)
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx', '--overwrite']) == 2
  assert capsys.readouterr().err == (
      'parity: error: moving the conversion into DST failed: [Errno 5] Input/output error;'
      ' nothing written to DST, SRC untouched\n'
  )
  assert os.listdir(dst) == ['old.txt']
  _assert_no_partials(dst)


def test_a_swap_that_cannot_put_the_old_dst_back_says_where_it_is(source, tmp_path, capsys, monkeypatch):
  """Both renames into DST fail: the message names where the old DST sits, and the next
  conversion to DST, while DST is absent, puts it back."""
  dst = _an_old_dst(tmp_path)
  rename = os.rename

  def failing_rename(a, b):
    if b == dst:  # the new output, then the old DST put back
      raise OSError(errno.EIO, 'Input/output error')
    rename(a, b)

  monkeypatch.setattr(os, 'rename', failing_rename)
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx', '--overwrite']) == 2
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
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx']) == 2  # not empty: the old DST is back
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
def test_sigterm_during_the_swap(source, tmp_path, when):
  """SIGTERM waits for the swap of `--overwrite`; after it, DST holds the conversion, said so."""
  dst = _an_old_dst(tmp_path)
  child = subprocess.run(
      [sys.executable, '-c', _SIGNALLED_SWAP.format(repo=REPO), when, 'convert', source.dir, dst, '--to', 'nnx',
       '--overwrite'],
      capture_output=True, text=True, timeout=120,
  )
  assert child.returncode == 2, child.stderr
  assert child.stderr.endswith(
      'parity: error: interrupted by signal 15 after the conversion was moved into place;'
      ' DST holds it, SRC untouched\n'
  ), child.stderr
  assert os.listdir(dst) == [str(STEP)]
  _assert_no_partials(dst)


def _raise(error):
  def fail(*args, **kwargs):
    raise error
  return fail


@pytest.mark.parametrize('target,error,stage', [
    ((pair_convert.writing._Writer, 'finish_as'),
     ValueError('OUT_OF_RANGE: Error writing "0.x/c/0/0": File too large\nmore'),
     'writing the converted arrays failed: OUT_OF_RANGE: Error writing "0.x/c/0/0": File too large'),
    ((shutil, 'copytree'), OSError(errno.ENOSPC, 'No space left on device'),
     'writing the converted arrays failed: [Errno 28] No space left on device'),  # copying the rng item
    ((os, 'fsync'), OSError(errno.EIO, 'Input/output error'),
     'syncing the conversion to disk failed: [Errno 5] Input/output error'),
], ids=['tensorstore', 'copytree', 'fsync'])
def test_a_write_failure_is_one_line(source, tmp_path, capsys, monkeypatch, target, error, stage):
  dst = str(tmp_path / 'dst')
  monkeypatch.setattr(*target, _raise(error))
  err = _refused(['convert', source.dir, dst, '--to', 'nnx'], capsys, dst)
  assert err == f'parity: error: {stage}; nothing written to DST, SRC untouched\n'


_SMALL_FILES = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {repo!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    from parity.run import cli
    from parity.store.pair_convert import atomic
    make_partial = atomic.make_partial
    def limited(dst):  # files limited from here on: the pair is made, the conversion not yet written
      resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
      return make_partial(dst)
    atomic.make_partial = limited
    sys.exit(cli.main(sys.argv[1:]))
""")


def test_a_file_too_large_is_one_line(sources, tmp_path):
  """A real write failure: files are limited to 20 kB (RLIMIT_FSIZE); the output's arrays are larger."""
  source = sources['10_scan_axis0']
  dst = str(tmp_path / 'dst')
  child = subprocess.run(
      [sys.executable, '-c', _SMALL_FILES.format(repo=REPO), 'convert', source.dir, dst, '--to', 'nnx',
       '--scenario', '10_scan_axis0'],
      capture_output=True, text=True, timeout=120,
  )
  assert child.returncode == 2, child.stderr
  assert re.search(
      r'(^|\n)parity: error: writing the converted arrays failed: \S+: .*File too large.*;'
      r' nothing written to DST, SRC untouched\n$', child.stderr
  ), child.stderr
  assert 'tensorstore_spec' not in child.stderr  # a long JSON, left out
  assert not os.path.exists(dst)
  _assert_no_partials(dst)


def test_verify_says_plainly_where_the_model_does_not_fit(source, tmp_path, capsys, monkeypatch):
  """`--verify` restores and trains both sides: where the two states exceed the devices' memory it is
  refused before anything is written, saying what to do instead."""
  from parity.store.pair_convert import converting

  monkeypatch.setattr(converting, '_memory_free', lambda mesh: (1000, 'host memory available'))
  dst = str(tmp_path / 'dst')
  err = _refused(['convert', source.dir, dst, '--to', 'nnx', '--verify'], capsys, dst)
  assert re.match(r'parity: error: --verify restores both states and trains each one step: at least \S+ GB'
                  r' \(twice the \S+ GB state\), more than the 0\.00 GB host memory available\. Convert without'
                  r' --verify', err), err
  assert err.endswith('nothing written to DST, SRC untouched\n'), err


def test_verify_works_where_the_model_fits(source, tmp_path, capsys):
  """`--verify` without `--pair`: the reference's sides restore SRC and the conversion with their own
  restore code and train one step each, bit for bit."""
  dst = str(tmp_path / 'dst')
  assert cli.main(['convert', source.dir, dst, '--to', 'nnx', '--verify']) == 0, capsys.readouterr()
  assert 'verified: one train step on each side, bit for bit' in capsys.readouterr().out
