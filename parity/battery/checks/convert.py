"""The convert part: a side's own checkpoint, converted and resumed on the other side."""
from __future__ import annotations

import tempfile

from parity.battery.checks.shared import _battery_frames_hidden, _runs, compare, per_step
from parity.pairs import adapter


def check_convert(pair: adapter.Pair, direction: str) -> list[str]:
  """A checkpoint saved by one side's own code (a StandardCheckpointer save of its state after one
  step), converted to the other side's through the pair's correspondences (parity/store/pair_convert/),
  restored by the other side as its own code restores it, resumes bit for bit: the remaining
  steps' metrics and final state equal an uninterrupted run's."""
  __tracebackhide__ = _battery_frames_hidden
  import orbax.checkpoint as ocp

  from parity.store import pair_convert

  runs = _runs(pair)
  src_name, dst_name = direction.split('->')
  src, dst = runs.side(src_name), runs.side(dst_name)
  state, m = src.train_step(src.from_checkpoint(runs.start('linen')), runs.batch(0), runs.dropout_base())
  metrics = [dict(m)]
  with tempfile.TemporaryDirectory() as d:
    saver = ocp.StandardCheckpointer()
    saver.save(f'{d}/own', pair_convert.own_tree(pair, src_name, src, state))
    saver.wait_until_finished()
    result = pair_convert.convert_checkpoint(pair, f'{d}/own', f'{d}/converted', dst_name, sides=runs.sides())
    layouts = pair_convert.pair_layouts(runs.sides(), pair.saves)
    item = pair_convert.locate(f'{d}/converted', 'DST')
    state = pair_convert.restore_native(item, layouts[result.target_format], dst)
  for step in range(1, pair.steps):
    state, m = dst.train_step(state, runs.batch(step), runs.dropout_base())
    metrics.append(dict(m))
  ref_metrics, ref_final, _ = runs.trajectory(src_name, 'linen')
  found = compare(pair, 'train', {**per_step(ref_metrics), **ref_final}, {**per_step(metrics), **dst.to_checkpoint(state)},
                  f'{src_name}\'s own checkpoint after step 0, converted ({result.source_format} ->'
                  f' {result.target_format}) and resumed in {dst_name}, vs an uninterrupted {src_name} run',
                  labels=(f'uninterrupted {src_name}', f'converted into {dst_name}'))
  notes = [f'{result.source_format} -> {result.target_format}: {result.arrays} arrays']
  if result.dropped or result.initialised:
    notes.append(f'state only NNX keeps: {len(result.dropped)} leaves left out, {len(result.initialised)}'
                 ' as create(0) makes them')
  return notes + found
