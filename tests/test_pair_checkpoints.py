"""A pair's own checkpoints across its sides (parity/store/pair_convert/): each side's own save
code in, the other side's own restore code out, verified by one train step on each side; two
checkpoints compared leaf by leaf; bad input refused with nothing written.

The tiny pair (tests/checkpoint_pairs.py) carries everything a conversion must: Linen's automatic
names against NNX attributes, `batch_stats`, an optax chain with empty states, Adam's moments,
the step's two dtypes and an RNG stream only NNX keeps. The family pairs' conversions (their own
create and train functions, the production pair on its mesh) are the exhaustive tier's; every
pair's battery converts its own checkpoints in `test_convert` (parity/battery/checks/convert.py).
"""
from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import parity
from parity.core import bitwise
from parity.core import paths
from parity.core import rng
from parity.core.errors import TreeMismatchError
from parity.run import cli
from parity.store import pair_convert
from parity.store.pair_convert.atomic import ConvertError
from tests import checkpoint_pairs as tiny_pairs

# One worker runs them: they share the module's checkpoints and the tiny pair's compiled steps.
pytestmark = pytest.mark.xdist_group('pair-checkpoints')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR_SPEC = os.path.join(REPO, 'tests', 'checkpoint_pairs.py') + ':tiny'
RNG_LEAVES = ['0/drop/rngs/count', '0/drop/rngs/key']
STEPS = 2


def _save(path, tree) -> None:
  """What a user's training code writes: one StandardCheckpointer save."""
  saver = ocp.StandardCheckpointer()
  saver.save(os.fspath(path), tree)
  saver.wait_until_finished()


def _restore(path, abstract):
  """What a user's training code reads back: a StandardCheckpointer restore into its abstract state."""
  return ocp.StandardCheckpointer().restore(os.fspath(path), abstract)


def _linen_abstract():
  return jax.eval_shape(tiny_pairs.linen_create, 0)


def _nnx_abstract():
  return nnx.state(nnx.eval_shape(lambda: tiny_pairs.nnx_create(0)))


def _nothing_written(dst) -> None:
  dst = os.fspath(dst)
  parent = os.path.dirname(dst)
  left = [n for n in os.listdir(parent) if n.startswith(f'.{os.path.basename(dst)}.partial-')]
  assert not os.path.lexists(dst) and not left, (dst, left)


@pytest.fixture(scope='module')
def own(tmp_path_factory):
  """Each side's own checkpoints after two steps: Linen's TrainState, NNX's state (as an
  `nnx.State`, a pure dict, and an item of a CheckpointManager step with a JSON item beside it).
  The sides start from their own inits, so their numbers differ."""
  root = tmp_path_factory.mktemp('own')
  base = rng.base_key(tiny_pairs.tiny.seed)
  state = tiny_pairs.linen_create(0)
  for step in range(STEPS):
    state, _ = tiny_pairs.linen_train(state, tiny_pairs.batch(step), base)
  _save(root / 'linen', state)
  model, optimizer = tiny_pairs.nnx_create(1)
  for step in range(STEPS):
    tiny_pairs.nnx_train(model, optimizer, tiny_pairs.batch(step), base)
  nnx_state = nnx.state((model, optimizer))
  _save(root / 'nnx', nnx_state)
  _save(root / 'nnx_pure', nnx.to_pure_dict(nnx_state))
  manager = ocp.CheckpointManager(os.fspath(root / 'nnx_manager'))
  manager.save(STEPS, args=ocp.args.Composite(state=ocp.args.StandardSave(nnx_state),
                                               meta=ocp.args.JsonSave({'epoch': 3})))
  manager.wait_until_finished()
  manager.close()
  return root, state, (model, optimizer)


def _checkpoint_layout(role: str, state) -> dict:
  """A side's state in the pair's checkpoint layout (the kit's flat view, for comparing)."""
  linen, nnx_side = pair_convert.pair_sides(tiny_pairs.tiny)
  return linen.to_checkpoint(jax.tree.map(jax.numpy.asarray, state)) if role == 'linen' else nnx_side.to_checkpoint(state)


def test_a_linen_checkpoint_converts_to_one_nnx_restores_and_resumes_from(own, tmp_path):
  root, linen_state, _ = own
  result = parity.convert_checkpoint(tiny_pairs.tiny, root / 'linen', tmp_path / 'nnx', 'nnx', verify=True)
  assert (result.verified, result.written, result.differences) == (True, True, [])
  assert (result.source_format, result.target_format) == ('linen', 'nnx')
  assert result.initialised == [f'{p}/value' for p in RNG_LEAVES]  # as create(0) makes them
  restored = _restore(tmp_path / 'nnx', _nnx_abstract())  # NNX's own restore code
  assert restored[1]['step'][...].dtype == np.uint32 and int(restored[1]['step'][...]) == STEPS
  # Every leaf as the Linen state's, through the correspondences; the stream as create(0)'s.
  bitwise.assert_bitwise_equal(paths.flatten(restored), paths.flatten(parity.to_nnx_layout(tiny_pairs.tiny, linen_state)))
  fresh = nnx.state(tiny_pairs.nnx_create(0))
  bitwise.assert_bitwise_equal({p: paths.flatten(restored)[p] for p in RNG_LEAVES},
                               {p: paths.flatten(fresh)[p] for p in RNG_LEAVES})
  # NNX's own code resumes from it as Linen's goes on: the next step, bit for bit.
  graphdef = nnx.split(tiny_pairs.nnx_create(0))[0]
  model, optimizer = nnx.merge(graphdef, restored)
  base = rng.base_key(tiny_pairs.tiny.seed)
  nnx_loss = tiny_pairs.nnx_train(model, optimizer, tiny_pairs.batch(STEPS), base)['loss']
  linen_next, linen_metrics = tiny_pairs.linen_train(linen_state, tiny_pairs.batch(STEPS), base)
  bitwise.assert_bitwise_equal(
      {**_checkpoint_layout('linen', linen_next), 'loss': linen_metrics['loss']},
      {**_checkpoint_layout('nnx', nnx.state((model, optimizer))), 'loss': nnx_loss}, 'resumed steps')


@pytest.mark.parametrize('source', ['nnx', 'nnx_pure', 'nnx_manager'])
def test_nnx_checkpoints_convert_to_one_linen_restores(own, tmp_path, source):
  root, _, (model, optimizer) = own
  dst = tmp_path / 'linen'
  result = parity.convert_checkpoint(tiny_pairs.tiny, root / source, dst, 'linen', verify=True)
  assert (result.verified, result.written) == (True, True), result.differences
  assert result.source_format == ('nnx-pure' if source == 'nnx_pure' else 'nnx')
  assert result.dropped == [p + ('' if source == 'nnx_pure' else '/value') for p in RNG_LEAVES]
  if source == 'nnx_manager':  # the step and its other items, as the run's manager wrote them
    assert os.listdir(dst) == [str(STEPS)] and sorted(os.listdir(dst / str(STEPS)))[-2:] == ['meta', 'state']
    manager = ocp.CheckpointManager(os.fspath(dst), options=ocp.CheckpointManagerOptions(read_only=True))
    restored = manager.restore(STEPS, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_linen_abstract()), meta=ocp.args.JsonRestore()))
    manager.close()
    assert restored['meta'] == {'epoch': 3}
    restored = restored['state']
  else:
    restored = _restore(dst, _linen_abstract())  # Linen's own restore code
  assert isinstance(restored, tiny_pairs.TrainState) and restored.step.dtype == np.int32
  expected = parity.to_linen_layout(tiny_pairs.tiny, (model, optimizer))
  bitwise.assert_bitwise_equal(paths.flatten(restored), paths.flatten(expected), 'restored vs NNX state')
  bitwise.assert_bitwise_equal(_checkpoint_layout('linen', restored),
                               _checkpoint_layout('nnx', nnx.state((model, optimizer))))


def test_a_state_saved_in_the_other_layout_restores_there(own, tmp_path):
  """`parity.to_linen_layout` / `to_nnx_layout`: one side's training code saves checkpoints the
  other side's own restore code reads, with no conversion."""
  _, linen_state, (model, optimizer) = own
  _save(tmp_path / 'for_linen', parity.to_linen_layout(tiny_pairs.tiny, nnx.state((model, optimizer))))
  restored = _restore(tmp_path / 'for_linen', _linen_abstract())
  bitwise.assert_bitwise_equal(_checkpoint_layout('linen', restored),
                               _checkpoint_layout('nnx', nnx.state((model, optimizer))))
  _save(tmp_path / 'for_nnx', parity.to_nnx_layout(tiny_pairs.tiny, linen_state))
  restored = _restore(tmp_path / 'for_nnx', _nnx_abstract())
  bitwise.assert_bitwise_equal(_checkpoint_layout('nnx', restored), _checkpoint_layout('linen', linen_state))
  pure = parity.to_nnx_layout(tiny_pairs.tiny, linen_state, pure=True)
  assert set(pure) == {0, 1} and 'inp' in pure[0]


def test_a_conversion_that_does_not_resume_alike_fails_naming_each_leaf_and_writes_nothing(own, tmp_path):
  """The NNX side's train step scales its loss (tests/checkpoint_pairs.py): the restored states are
  equal, the states after one step are not, each leaf named on both sides; DST is not written."""
  root, _, _ = own
  result = parity.convert_checkpoint(tiny_pairs.tiny_broken_step, root / 'linen', tmp_path / 'nnx', 'nnx',
                                     verify=True)
  assert (result.verified, result.written) == (False, False)
  _nothing_written(tmp_path / 'nnx')
  assert not [line for line in result.differences if line.startswith('restored')], result.differences
  # A scaled loss scales the gradients, so Adam's first moments differ on every version; the
  # parameters Adam moves may or may not (its update is nearly scale-free: jax 0.12 rounds Dense_0's alike).
  assert any(line.startswith('after one step opt_state/1/0/mu/Dense_0/kernel [linen: opt_state/1/0/mu/Dense_0/kernel'
                             ' | nnx: 1/opt_state/1/0/mu/inp/kernel/value]: bits: float32[4, 8]')
             for line in result.differences)
  assert any(line.startswith('after one step metrics/loss: bits:') for line in result.differences)
  assert any('opt_state/1/0/nu/Dense_1/bias [linen: opt_state/1/0/nu/Dense_1/bias | nnx:'
             ' 1/opt_state/1/0/nu/out/bias/value]' in line for line in result.differences)


def test_a_conversion_the_other_side_cannot_restore_fails_verification(own, tmp_path, monkeypatch):
  root, _, _ = own
  real = pair_convert.restore_native

  def restore(item, layout, side):
    if '.partial-' in item.path:  # the conversion, before it is moved into DST
      raise ValueError('a tree its restore code does not read\nmore lines')
    return real(item, layout, side)

  monkeypatch.setattr(pair_convert.restore, 'restore_native', restore)
  result = parity.convert_checkpoint(tiny_pairs.tiny, root / 'linen', tmp_path / 'nnx', 'nnx', verify=True)
  assert (result.verified, result.written) == (False, False)
  assert result.differences == ["the conversion cannot be restored by the nnx side's own restore code (nnx):"
                                ' ValueError: a tree its restore code does not read']
  _nothing_written(tmp_path / 'nnx')


def test_the_cli_converts_and_verifies_and_says_what(own, tmp_path, capsys):
  root, _, _ = own
  assert cli.main(['convert', '--pair', PAIR_SPEC, os.fspath(root / 'nnx_manager'), os.fspath(tmp_path / 'linen'),
                   '--to', 'linen', '--verify']) == 0
  out = capsys.readouterr().out
  assert 'converted pair checkpoint_tiny nnx -> linen (step 2): 22 arrays' in out, out
  assert 'verified: one train step on each side, bit for bit' in out, out
  assert 'left out 2 leaves only NNX keeps (0/drop/rngs/count/value, 0/drop/rngs/key/value)' in out, out
  broken = os.path.join(REPO, 'tests', 'checkpoint_pairs.py') + ':tiny_broken_step'
  assert cli.main(['convert', '--pair', broken, os.fspath(root / 'linen'), os.fspath(tmp_path / 'nnx'),
                   '--to', 'nnx', '--verify']) == 1
  out = capsys.readouterr().out
  assert 'verification failed' in out and 'after one step opt_state/1/0/mu/Dense_0/kernel [linen:' in out, out
  _nothing_written(tmp_path / 'nnx')


def test_diff_names_a_swap_of_mu_and_nu_a_transposed_kernel_and_a_step_off_by_one(own, tmp_path, capsys):
  root, linen_state, _ = own
  parity.convert_checkpoint(tiny_pairs.tiny, root / 'linen', tmp_path / 'nnx', 'nnx')
  same = parity.compare_checkpoints(tiny_pairs.tiny, root / 'linen', tmp_path / 'nnx')
  assert same.equal and same.compared == 22 and len(same.not_compared) == 2, same.report()
  # The NNX side's own save (a pure dict) of the same state with three bugs planted.
  pure = parity.to_nnx_layout(tiny_pairs.tiny, linen_state, pure=True)
  adam = pure[1]['opt_state'][1][0]
  adam['mu']['inp']['kernel'], adam['nu']['inp']['kernel'] = adam['nu']['inp']['kernel'], adam['mu']['inp']['kernel']
  pure[0]['out']['kernel'] = pure[0]['out']['kernel'].T
  pure[1]['step'] = pure[1]['step'] + 1
  _save(tmp_path / 'planted', pure)
  diff = parity.compare_checkpoints(tiny_pairs.tiny, root / 'linen', tmp_path / 'planted')
  assert not diff.equal and diff.kinds == {'values': 3, 'shape': 1}, diff.report()
  heads = [line.split(': ', 3)[:3] for line in diff.differences]
  assert [line[:2] for line in heads] == [
      ['opt_state/1/0/mu/Dense_0/kernel [A linen', 'opt_state/1/0/mu/Dense_0/kernel | B nnx-pure'],
      ['opt_state/1/0/nu/Dense_0/kernel [A linen', 'opt_state/1/0/nu/Dense_0/kernel | B nnx-pure'],
      ['params/Dense_1/kernel [A linen', 'params/Dense_1/kernel | B nnx-pure'],
      ['step [A linen', 'step | B nnx-pure'],
  ], diff.differences
  assert diff.differences[0].startswith('opt_state/1/0/mu/Dense_0/kernel [A linen: opt_state/1/0/mu/Dense_0/kernel'
                                        ' | B nnx-pure: 1/opt_state/1/0/mu/inp/kernel]: values: float32[4, 8]: ')
  assert 'max ULP distance' in diff.differences[0]
  assert diff.differences[2] == ('params/Dense_1/kernel [A linen: params/Dense_1/kernel | B nnx-pure: 0/out/kernel]:'
                                 ' shape: [8, 3] vs [3, 8]')
  assert diff.differences[3].startswith('step [A linen: step | B nnx-pure: 1/step]: values: int32 vs uint32 by'
                                        ' design, compared as integers: int64[]: 1 of 1 elements differ, max abs diff 1')
  # The command: exit 1 with the leaves and the summary, 0 for two equal checkpoints of one side.
  assert cli.main(['diff-checkpoints', '--pair', PAIR_SPEC, os.fspath(root / 'linen'),
                   os.fspath(tmp_path / 'planted')]) == 1
  out = capsys.readouterr().out
  assert 'params/Dense_1/kernel [A linen: params/Dense_1/kernel | B nnx-pure: 0/out/kernel]: shape' in out, out
  assert 'DIFFERENT: 4 differences (1 shape, 3 values)' in out, out
  shutil.copytree(root / 'linen', tmp_path / 'linen_copy')
  assert cli.main(['diff-checkpoints', '--pair', PAIR_SPEC, os.fspath(root / 'linen'),
                   os.fspath(tmp_path / 'linen_copy')]) == 0
  assert 'EQUAL (bit for bit)' in capsys.readouterr().out


def test_diff_names_a_leaf_recorded_on_another_device(own, tmp_path):
  """Shardings as each checkpoint records them (`_sharding`): one leaf placed elsewhere is named."""
  import base64

  root, _, _ = own
  shutil.copytree(root / 'linen', tmp_path / 'moved')
  recorded = json.loads((tmp_path / 'moved' / '_sharding').read_text())
  key = base64.urlsafe_b64encode(b'params.Dense_0.kernel').decode()
  entry = json.loads(recorded[key])
  recorded[key] = json.dumps({**entry, 'device_str': 'cpu:7'})
  (tmp_path / 'moved' / '_sharding').write_text(json.dumps(recorded))
  diff = parity.compare_checkpoints(tiny_pairs.tiny, root / 'linen', tmp_path / 'moved')
  assert diff.kinds == {'sharding': 1}, diff.report()
  assert diff.differences[0].startswith('params/Dense_0/kernel [A linen: params/Dense_0/kernel | B linen:'
                                        ' params/Dense_0/kernel]: sharding: ')
  assert "'device_str': 'cpu:0'" in diff.differences[0] and "'device_str': 'cpu:7'" in diff.differences[0]


def test_diff_streams_each_leaf_a_box_pair_at_a_time_and_says_what_a_whole_array_comparison_says(
    own, tmp_path, monkeypatch):
  """diff-checkpoints never holds two whole arrays: with a budget of 16 bytes a box, a float32[4, 8]
  kernel is read in 8 box pairs of 4 elements, and every leaf's line (count, max abs diff, max ULP
  distance, first differing index and its values) is what comparing the whole arrays says."""
  root, linen_state, _ = own
  pure = parity.to_nnx_layout(tiny_pairs.tiny, linen_state, pure=True)
  kernel = np.array(pure[0]['inp']['kernel'])
  planted = kernel.copy()
  planted[3, 6] = np.nextafter(planted[3, 6], np.float32(np.inf))  # 1 ULP, in the last box
  planted[1, 5] = -planted[1, 5]  # across zero: the first difference, in the fourth box
  planted[2, 0] = planted[2, 0] * np.float32(1.5)
  pure[0]['inp']['kernel'] = jax.numpy.asarray(planted)  # a jax.Array: its sharding recorded as the others'
  adam = pure[1]['opt_state'][1][0]
  adam['mu']['inp']['kernel'], adam['nu']['inp']['kernel'] = adam['nu']['inp']['kernel'], adam['mu']['inp']['kernel']
  pure[1]['step'] = pure[1]['step'] + 1
  _save(tmp_path / 'planted', pure)
  whole = parity.compare_checkpoints(tiny_pairs.tiny, root / 'linen', tmp_path / 'planted')

  reads = []
  read_pair = pair_convert._read_pair

  def spy(items, stored, stores, box):
    xa, xb = read_pair(items, stored, stores, box)
    reads.append((stored[0].disk, box, xa.nbytes, xb.nbytes))
    return xa, xb

  monkeypatch.setattr(pair_convert.comparing, 'DIFF_BOX_BYTES', 16)
  monkeypatch.setattr(pair_convert.comparing, '_read_pair', spy)
  streamed = parity.compare_checkpoints(tiny_pairs.tiny, root / 'linen', tmp_path / 'planted')
  kernel_reads = [(box, na, nb) for disk, box, na, nb in reads if disk == 'params/Dense_0/kernel']
  assert len(kernel_reads) == 8 and all(na == nb == 16 for _, na, nb in kernel_reads), kernel_reads
  assert sorted((b[0].start, b[1].start) for b, _, _ in kernel_reads) == [(r, c) for r in range(4) for c in (0, 4)]
  assert max(max(na, nb) for _, _, na, nb in reads) <= 16, reads
  # The same lines as with whole arrays, and the kernel's as bitwise.compare_leaves says of the whole arrays.
  assert streamed.differences == whole.differences and streamed.kinds == whole.kinds == {'values': 4}
  expected = bitwise.compare_leaves('k', np.asarray(linen_state.params['Dense_0']['kernel']), planted).detail
  assert ('params/Dense_0/kernel [A linen: params/Dense_0/kernel | B nnx-pure: 0/inp/kernel]: values: '
          + expected) in streamed.differences, streamed.differences
  assert '3 of 32 elements differ' in expected and 'first at index [1, 5]' in expected, expected
  assert '1 of them of opposite sign' in expected, expected
  assert any(line.startswith('step [A linen: step | B nnx-pure: 1/step]: values: int32 vs uint32 by design,'
                             ' compared as integers: int64[]: 1 of 1 elements differ, max abs diff 1')
             for line in streamed.differences), streamed.differences


@pytest.mark.parametrize('chunks', [((2, 10), (2, 10)), ((6, 3), (6, 3)), ((2, 10), (6, 3)), ((6, 3), (4, 4))])
def test_a_streamed_comparison_across_chunk_grids_is_the_whole_array_comparison(tmp_path, monkeypatch, chunks):
  """Two arrays stored in chunks of their own, compared in boxes smaller than a chunk: the detail is
  `bitwise.compare_leaves`'s of the whole arrays (the first difference in C order, not in chunk order)."""
  import tensorstore as ts

  gen = np.random.default_rng(0)
  a = gen.standard_normal((6, 10)).astype(np.float32)
  b = a.copy()
  b[0, 7] = np.nextafter(b[0, 7], np.float32(0))  # first in C order; in the second column chunk of (6, 3)
  b[4, 1], b[5, 9] = -b[4, 1], b[5, 9] * np.float32(3)
  items, stored = [], []
  for side, (x, chunk) in zip('ab', ((a, chunks[0]), (b, chunks[1]))):
    item_dir = tmp_path / side
    spec = pair_convert._store_spec(os.fspath(item_dir), 'x', zarr3=False, ocdbt=False)
    spec['metadata'] = {'shape': [6, 10], 'chunks': list(chunk), 'dtype': '<f4', 'compressor': None}
    ts.open(spec, create=True).result().write(x).result()
    items.append(pair_convert.Item(os.fspath(item_dir), 'checkpointer', os.fspath(item_dir)))
    stored.append(pair_convert.Stored('x', 'x', (6, 10), np.dtype(np.float32), chunk, {}, False, False))
  monkeypatch.setattr(pair_convert.comparing, 'DIFF_BOX_BYTES', 8)
  expected = bitwise.compare_leaves('x', a, b).detail
  assert 'first at index [0, 7]' in expected, expected
  assert pair_convert._compare_arrays(items, stored[0], stored[1], cast=False) == expected
  assert pair_convert._compare_arrays([items[0]] * 2, stored[0], stored[0], cast=False) is None


# ------------------------------------------------------------- bad input ---


def _linen_dict(state) -> dict:
  """A TrainState's saved tree as a dict (the same paths Orbax writes for the TrainState)."""
  return {'step': state.step, 'params': jax.tree.map(lambda x: x, state.params), 'opt_state': state.opt_state,
          'batch_stats': state.batch_stats}


def _bad_source(kind: str, root, linen_state, where) -> str:
  src = where / kind
  if kind == 'missing_and_extra':
    tree = _linen_dict(linen_state)
    del tree['params']['Dense_1']['bias']
    tree['params']['Extra'] = {'kernel': np.zeros((2, 2), np.float32)}
    _save(src, tree)
  elif kind == 'shape_and_dtype':
    tree = _linen_dict(linen_state)
    tree['params']['Dense_0']['kernel'] = tree['params']['Dense_0']['kernel'].T
    tree['params']['Dense_0']['bias'] = tree['params']['Dense_0']['bias'].astype(np.float16)
    _save(src, tree)
  elif kind == 'truncated':
    shutil.copytree(root / 'linen', src)
    for data in glob.glob(os.path.join(src, '**', 'd', '*'), recursive=True):
      with open(data, 'r+b') as f:
        f.truncate(os.path.getsize(data) // 2)
  elif kind == 'half_written':
    shutil.copytree(root / 'linen', src)
    os.remove(src / '_CHECKPOINT_METADATA')
  elif kind == 'unfinished':
    src = where / 'linen.orbax-checkpoint-tmp-1234'
    shutil.copytree(root / 'linen', src)
  elif kind == 'not_a_checkpoint':
    os.makedirs(src)
  else:
    src = root / 'linen'
  return os.fspath(src)


BAD = {
    'wrong_pair': ("is not a checkpoint of pair 'classifier'", 'params/Dense_0/kernel: shape: expected [16, 10]'),
    'missing_and_extra': ('params/Dense_1/bias: missing: expected float32[3], got nothing',
                          'params/Extra/kernel: extra: expected nothing, got float32[2, 2]'),
    'shape_and_dtype': ('params/Dense_0/bias: dtype: expected float32, got float16',
                        'params/Dense_0/kernel: shape: expected [4, 8], got [8, 4]'),
    'truncated': ('cannot be read (file missing, truncated or corrupted)', 'linen/truncated'),
    'half_written': ('is half-written: _CHECKPOINT_METADATA is missing', 'half_written'),
    'unfinished': ('is an unfinished Orbax save', 'linen.orbax-checkpoint-tmp-1234'),
    'not_a_checkpoint': ('is not an Orbax checkpoint: neither a StandardCheckpointer directory', 'not_a_checkpoint'),
    'dst_exists': ('is not empty; pass --overwrite to replace it', 'dst'),
    'already_there': ("is already the linen side's checkpoint: nothing to convert", 'linen'),
}


@pytest.mark.parametrize('kind', list(BAD))
def test_bad_input_is_refused_naming_the_leaf_or_the_file_and_nothing_is_written(own, tmp_path, capsys, kind):
  root, linen_state, _ = own
  os.makedirs(tmp_path / 'linen')
  src = _bad_source(kind, root, linen_state, tmp_path / 'linen')
  dst = tmp_path / 'dst'
  if kind == 'dst_exists':
    os.makedirs(dst)
    (dst / 'mine.txt').write_text('kept')
  spec = os.path.join(REPO, 'tests', 'test_family_classifier.py') + ':classifier' if kind == 'wrong_pair' else PAIR_SPEC
  to = 'linen' if kind == 'already_there' else 'nnx'
  assert cli.main(['convert', '--pair', spec, src, os.fspath(dst), '--to', to]) == 2
  err = capsys.readouterr().err
  for fragment in BAD[kind]:
    assert fragment in err, err
  assert err.startswith('parity: error: ') and 'Traceback' not in err
  if kind == 'dst_exists':
    assert os.listdir(dst) == ['mine.txt'] and (dst / 'mine.txt').read_text() == 'kept'
    assert not [n for n in os.listdir(tmp_path) if n.startswith('.dst.partial-')]
  else:
    _nothing_written(dst)


def test_each_converters_options_are_refused_with_the_other(own, tmp_path, capsys):
  """One converter: `--preset`/`--scenario` choose the reference decoder's pair, so not with `--pair`;
  `--mesh` is `--verify`'s; the reference converter's `--layout` is gone (a pair's renames say it)."""
  root, _, _ = own
  dst = os.fspath(tmp_path / 'dst')
  assert cli.main(['convert', '--pair', PAIR_SPEC, os.fspath(root / 'linen'), dst, '--to', 'nnx',
                   '--preset', 'tiny']) == 2
  assert "--preset and --scenario choose the reference decoder's pair" in capsys.readouterr().err
  assert cli.main(['convert', '--pair', PAIR_SPEC, os.fspath(root / 'linen'), dst, '--to', 'nnx', '--mesh', 'data=8']) == 2
  assert '--mesh: only with --verify' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(['convert', '--pair', PAIR_SPEC, os.fspath(root / 'linen'), dst, '--to', 'nnx', '--layout', 'scan_axis0'])
  assert 'unrecognized arguments: --layout scan_axis0' in capsys.readouterr().err
  _nothing_written(dst)


def test_a_failure_while_writing_leaves_nothing_at_dst(own, tmp_path, monkeypatch):
  """A write that fails half-way (here a full disk after the arrays are written): one ConvertError
  saying what, the temporary directory removed, nothing at DST."""
  root, _, _ = own

  def full(*args, **kwargs):
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(pair_convert.writing, '_write_array_metadatas', full)
  with pytest.raises(ConvertError, match=r'writing the converted arrays failed: .*No space left on device;'
                                         r' nothing written to DST, SRC untouched'):
    parity.convert_checkpoint(tiny_pairs.tiny, root / 'linen', tmp_path / 'nnx', 'nnx')
  _nothing_written(tmp_path / 'nnx')


def test_the_api_raises_what_the_cli_reports(own, tmp_path):
  root, linen_state, _ = own
  with pytest.raises(TreeMismatchError, match=r'params/Extra/kernel: extra'):
    parity.convert_checkpoint(tiny_pairs.tiny, _bad_source('missing_and_extra', root, linen_state, tmp_path), tmp_path / 'd', 'nnx')
  with pytest.raises(ConvertError, match=r'--to must be'):
    parity.convert_checkpoint(tiny_pairs.tiny, root / 'linen', tmp_path / 'd', 'jax')
  with pytest.raises(ConvertError, match=r"target format 'linen' is not the nnx side's"):
    parity.convert_checkpoint(tiny_pairs.tiny, root / 'linen', tmp_path / 'd', 'nnx', target_format='linen')
  with pytest.raises(ConvertError, match=r'B .*not_a_checkpoint is not an Orbax checkpoint'):
    parity.compare_checkpoints(tiny_pairs.tiny, root / 'linen', _bad_source('not_a_checkpoint', root, linen_state, tmp_path))
  _nothing_written(tmp_path / 'd')


def test_the_converted_metadata_is_what_orbax_writes(own, tmp_path):
  """`_METADATA` in Orbax's order with its placeholders (an optax EmptyState() as 'None'), key types
  as Orbax's (a tuple's index 1, a field 2): a restore without a target rebuilds the same tree."""
  root, _, _ = own
  parity.convert_checkpoint(tiny_pairs.tiny, root / 'nnx', tmp_path / 'linen', 'linen')
  written = json.loads((tmp_path / 'linen' / '_METADATA').read_text())['tree_metadata']
  original = json.loads((root / 'linen' / '_METADATA').read_text())['tree_metadata']
  assert list(written) == list(original)
  assert [e['key_metadata'] for e in written.values()] == [e['key_metadata'] for e in original.values()]
  assert written["('opt_state', '0')"]['value_metadata'] == {'value_type': 'None', 'skip_deserialize': True}
  untargeted = ocp.StandardCheckpointer().restore(os.fspath(tmp_path / 'linen'))
  assert sorted(paths.flatten(untargeted)) == sorted(paths.flatten(_restore(root / 'linen', _linen_abstract())))


# ------------------------------------------------------- the family pairs ---


# The pair, and the family's own Linen and NNX modules (create_train_state, train_step).
FAMILIES = {
    'classifier': ('tests/test_family_classifier.py:classifier', 'models.linen.classifier', 'models.nnx.classifier'),
    'lm': ('tests/test_family_lm.py:lm', 'models.linen.lm', 'models.nnx.lm'),
}


@pytest.mark.exhaustive
@pytest.mark.parametrize('family', list(FAMILIES))
def test_a_family_converts_both_ways_from_its_own_save_code_verified(family, tmp_path, capsys):
  """The family's own create and train functions (the language model's Linen state boxed, as its
  `create_train_state` makes it), saved with StandardCheckpointer, converted both ways by the
  command with --verify: one train step on each side, bit for bit."""
  import importlib

  from parity.core import compat

  spec, linen_module, nnx_module = FAMILIES[family]
  pair = cli._load_pair(os.path.join(REPO, spec))
  linen_lib, nnx_lib = importlib.import_module(linen_module), importlib.import_module(nnx_module)
  cfg = pair.make_sides(None)[0].create.args[0]  # the config the pair's sides are made with (a partial's)
  base = rng.base_key(pair.seed)
  state = linen_lib.create_train_state(cfg, 0)
  state, _ = linen_lib.train_step(state, pair.batch(0, 'train'), base)
  _save(tmp_path / 'linen', state)
  with compat.eager_sharding_off():
    model, optimizer = nnx_lib.create_train_state(cfg, 0)
  nnx_lib.train_step(model, optimizer, pair.batch(0, 'train'), base)
  _save(tmp_path / 'nnx', nnx.state((model, optimizer)))
  full = os.path.join(REPO, spec)
  for src, dst, to in (('linen', 'to_nnx', 'nnx'), ('nnx', 'to_linen', 'linen')):
    code = cli.main(['convert', '--pair', full, os.fspath(tmp_path / src), os.fspath(tmp_path / dst), '--to', to,
                     '--verify'])
    out = capsys.readouterr().out
    assert code == 0 and 'verified: one train step on each side, bit for bit' in out, out
    assert cli.main(['diff-checkpoints', '--pair', full, os.fspath(tmp_path / src), os.fspath(tmp_path / dst)]) == 0


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-production')
def test_the_production_pair_converts_both_ways_on_its_mesh_verified(tmp_path):
  """The scanned, rematerialised production pair on its 5-axis mesh: each side's sharded state (its
  own steps under the mesh and rules) saved with StandardCheckpointer, converted both ways and
  verified on that mesh; the RNG streams only NNX keeps left out of Linen's and made as create(0)
  makes them in NNX's."""
  pair = cli._load_pair(os.path.join(REPO, 'tests', 'test_family_production.py') + ':production')
  mesh = pair.mesh(pair.meshes[0])
  linen, nnx_side = pair_convert.pair_sides(pair, mesh)
  base = rng.base_key(pair.seed)
  for role, side in (('linen', linen), ('nnx', nnx_side)):
    state, _ = side.train_step(side.init(0), side.place_batch(pair.batch(0, 'train')), base)
    _save(tmp_path / role, state)
  to_nnx = parity.convert_checkpoint(pair, tmp_path / 'linen', tmp_path / 'to_nnx', 'nnx', verify=True, mesh=mesh)
  to_linen = parity.convert_checkpoint(pair, tmp_path / 'nnx', tmp_path / 'to_linen', 'linen', verify=True, mesh=mesh)
  assert to_nnx.verified and to_linen.verified, to_nnx.differences + to_linen.differences
  # Each dropout keeps a fork of the model's whole nnx.Rngs: its dropout, noise and params streams.
  streams = [f'0/layers/{dropout}/rngs/{stream}/{leaf}/value'
             for dropout in ('attention_dropout', 'mlp/dropout', 'mlp_dropout')
             for stream in ('dropout', 'noise', 'params') for leaf in ('count', 'key')]
  # NNX's stock tree read; written, the tree that codebase's own save writes (Pair.saves: nnx_aux/...).
  assert to_linen.dropped == streams and to_nnx.target_format == 'nnx-own'
  assert to_nnx.initialised == [s.replace('0/', 'nnx_aux/', 1).removesuffix('/value') for s in streams]
  assert to_linen.target_format == 'linen'  # boxed, as the production Linen model's create makes it
  diff = parity.compare_checkpoints(pair, tmp_path / 'nnx', tmp_path / 'to_linen')
  assert diff.equal and diff.not_compared, diff.report()


def test_diff_compares_the_state_only_nnx_keeps_between_two_nnx_checkpoints(own, tmp_path):
  """Two NNX checkpoints that differ only in an RNG stream's count (state no Linen checkpoint holds):
  the diff compares that state where both checkpoints hold it, and names the leaf."""
  _, _, (model, optimizer) = own
  pure = nnx.to_pure_dict(nnx.state((model, optimizer)))
  _save(tmp_path / 'a', pure)
  pure[0]['drop']['rngs']['count'] = pure[0]['drop']['rngs']['count'] + 1
  _save(tmp_path / 'b', pure)
  diff = parity.compare_checkpoints(tiny_pairs.tiny, tmp_path / 'a', tmp_path / 'b')
  assert not diff.equal and diff.kinds == {'values': 1}, diff.report()
  assert len(diff.differences) == 1 and '0/drop/rngs/count' in diff.differences[0], diff.differences
  assert parity.compare_checkpoints(tiny_pairs.tiny, tmp_path / 'a', tmp_path / 'a').equal
