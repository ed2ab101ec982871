"""A side whose own code saves a tree of its own (Pair.saves): the production pair's NNX training
writes Linen's on-disk tree plus `nnx_aux`, its RNG streams (models/nnx/prod.py), in a
CheckpointManager item, as that codebase's loop does; its Linen training writes its TrainState.

The conversions are restored with each codebase's own restore function, not the kit's."""
from __future__ import annotations

import dataclasses
import os

import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.core import meta

from models.linen import prod as linen_prod
from models.nnx import prod as nnx_prod
from parity.core import bitwise
from parity.core import paths
from parity.core import rng
from parity.run import cli
from parity.store import pair_convert
from parity.store.pair_convert.atomic import ConvertError
from tests import test_family_production as family

# The production pair's steps, compiled once by its battery on this worker.
pytestmark = pytest.mark.xdist_group('parity-production')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(REPO, 'tests', 'test_family_production.py') + ':production'


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """Each side's own CheckpointManager directory: step 0 (the common start) and step 1 (one train
  step on each side from it), saved by the codebase's own save functions."""
  root = tmp_path_factory.mktemp('own')
  pair = cli._load_pair(PAIR)
  linen, nnx_side = pair_convert.pair_sides(pair)
  batch, base = pair.batch(0, 'train'), rng.base_key(pair.seed)
  linen_start = linen.init(0)
  linen_next, _ = linen.train_step(linen_start, linen.place_batch(batch), base)
  nnx_next, _ = nnx_side.train_step(nnx_side.from_checkpoint(linen.to_checkpoint(linen_start)),
                                    nnx_side.place_batch(batch), base)
  with ocp.CheckpointManager(os.fspath(root / 'linen')) as manager:
    linen_prod.save_checkpoint(manager, 0, linen_start)
    linen_prod.save_checkpoint(manager, 1, linen_next)
  with ocp.CheckpointManager(os.fspath(root / 'nnx')) as manager:
    nnx_prod.save_checkpoint(manager, 1, nnx.merge(nnx_side.graphdef, nnx_next))
  return dataclasses.make_dataclass('Saved', ['root', 'pair', 'linen', 'nnx', 'linen_next'])(
      root, pair, linen, nnx_side, linen_next)


def _restored_by_the_nnx_codebase(directory, step=1):
  """A fresh train state (another seed), restored by models/nnx/prod.py's own restore_checkpoint."""
  train_state = nnx_prod.create_train_state(family.CFG, 5)
  with ocp.CheckpointManager(os.fspath(directory), options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
    nnx_prod.restore_checkpoint(manager, step, train_state)
  return train_state


def test_a_linen_checkpoint_converts_to_the_tree_the_nnx_codebases_own_restore_reads(saved, capsys):
  """Linen's own checkpoint, converted `--to nnx` with no --format: the NNX side's declared tree
  (Linen's leaves plus `nnx_aux`), verified; the codebase's own restore reads it, and the state it
  restores is Linen's, leaf for leaf, its streams as create(0) makes them."""
  dst = saved.root / 'to_nnx'
  assert cli.main(['convert', '--pair', PAIR, '--to', 'nnx', '--verify', os.fspath(saved.root / 'linen'),
                   os.fspath(dst)]) == 0
  out = capsys.readouterr().out
  assert 'linen-unboxed -> nnx-own (step 1)' in out and 'verified: one train step on each side, bit for bit' in out, out
  assert '18 leaves only NNX keeps as create(0) makes them (nnx_aux/layers/attention_dropout/rngs/dropout/count' in out
  model, optimizer = _restored_by_the_nnx_codebase(dst)
  restored = saved.nnx.to_checkpoint(nnx.state((model, optimizer)))
  assert bitwise.compare_trees(saved.linen.to_checkpoint(saved.linen_next), restored) == []
  fresh = nnx_prod.create_train_state(family.CFG, 0)[0]
  streams = bitwise.compare_trees(paths.flatten(nnx.state(fresh, nnx.RngState)),
                                  paths.flatten(nnx.state(model, nnx.RngState)))
  assert streams == [], streams


def test_the_kits_stock_nnx_tree_is_not_what_that_codebase_restores(saved):
  """The same conversion to the stock `nnx` tree (`nnx.state((model, optimizer))`): the codebase's
  own restore cannot read it, which is why the declared tree is the default."""
  dst = saved.root / 'to_stock_nnx'
  result = pair_convert.convert_checkpoint(saved.pair, saved.root / 'linen', dst, 'nnx', target_format='nnx')
  assert result.target_format == 'nnx'
  with pytest.raises(ValueError, match='tree structures do not match'):  # Orbax: its tree is not that one
    _restored_by_the_nnx_codebase(dst)


def test_the_nnx_codebases_checkpoint_converts_to_one_linens_own_restore_reads(saved, capsys):
  """The NNX codebase's own checkpoint (its tree, `nnx_aux` included), converted `--to linen` and
  verified; Linen's own restore reads it, equal to Linen's step; `nnx_aux` left out and said so."""
  dst = saved.root / 'to_linen'
  assert cli.main(['convert', '--pair', PAIR, '--to', 'linen', '--verify', os.fspath(saved.root / 'nnx'),
                   os.fspath(dst)]) == 0
  out = capsys.readouterr().out
  assert 'nnx-own -> linen (step 1)' in out and 'left out 18 leaves only NNX keeps (nnx_aux/layers/' in out, out
  with ocp.CheckpointManager(os.fspath(dst), options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
    restored = linen_prod.restore_checkpoint(manager, 1, saved.linen._boxed_template)
  found = bitwise.compare_trees(saved.linen.to_checkpoint(saved.linen_next), saved.linen.to_checkpoint(meta.unbox(restored)))
  assert found == [], found


def test_diff_between_the_two_codebases_checkpoints_names_values_and_nnx_aux_as_one_sided(saved, capsys):
  """Linen's and NNX's own checkpoints after the same step: equal, `nnx_aux` named as one-sided
  (exit 0). Linen's step 0 against NNX's step 1: exit 1, every difference a value (the step
  among them), nothing missing or extra, `nnx_aux` one-sided again."""
  linen_dir, nnx_dir = os.fspath(saved.root / 'linen'), os.fspath(saved.root / 'nnx')
  assert cli.main(['diff-checkpoints', '--pair', PAIR, linen_dir, nnx_dir]) == 0
  out = capsys.readouterr().out
  assert ("(nnx-own): 39 leaves compared; 18 leaves one-sided, state only the NNX side keeps, which the Linen"
          " side has no place for (nnx_aux/layers/attention_dropout/rngs/dropout/count") in out, out
  assert out.rstrip().endswith('not compared: EQUAL (bit for bit)'), out
  assert cli.main(['diff-checkpoints', '--pair', PAIR, '--step-a', '0', linen_dir, nnx_dir]) == 1
  out = capsys.readouterr().out
  lines = [line.strip() for line in out.splitlines() if line.startswith('  ')]
  assert lines and all(': values: ' in line for line in lines), out
  assert any(line.startswith('step [') for line in lines), out
  assert '18 leaves one-sided' in out and f'DIFFERENT: {len(lines)} differences ({len(lines)} values)' in out, out


def test_a_save_function_that_computes_a_leaf_is_refused_naming_it(saved):
  """A declared save whose tree holds a computed array (the embedding doubled): refused, naming the
  leaf and what computed it; a converter moves arrays, it does not recompute them."""
  def doubled(train_state):
    tree = nnx_prod.checkpoint_tree(train_state)
    tree['params']['embed']['embedding'] = tree['params']['embed']['embedding'] * 2
    return tree

  pair = dataclasses.replace(saved.pair, saves={'nnx': doubled})
  with pytest.raises(ConvertError) as refused:
    pair_convert.pair_layouts(pair_convert.pair_sides(saved.pair), pair.saves)
  message = str(refused.value)
  assert "Pair saves['nnx']: leaf params/embed/embedding of the saved tree is computed (mul)" in message, message


def test_a_step_or_an_item_directory_is_refused_naming_the_directory_and_flags_to_pass(saved):
  """Given one step's directory, or one item's, each command names what to pass instead, with its own
  flags: `--step` for convert's SRC, `--step-a`/`--step-b` for diff-checkpoints' A and B."""
  step_dir, item_dir = saved.root / 'nnx' / '1', saved.root / 'nnx' / '1' / 'items'
  for what, flag in (('SRC', '--step'), ('A', '--step-a'), ('B', '--step-b')):
    with pytest.raises(ConvertError) as step:
      pair_convert.locate(step_dir, what)
    assert f'is one step of a CheckpointManager directory; pass its parent (and {flag} 1)' in str(step.value)
    with pytest.raises(ConvertError) as item:
      pair_convert.locate(item_dir, what)
    assert (f"is item 'items' of step 1 of the CheckpointManager directory {saved.root / 'nnx'}: pass that"
            f" directory (with {flag} 1 --item items)") in str(item.value), str(item.value)
    assert 'half-written' not in str(item.value)
