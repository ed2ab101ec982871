"""The checkpoint and resume parts: the kit's own layout across sides, and resuming from it."""
from __future__ import annotations

import tempfile

from parity.battery.checks.shared import _battery_frames_hidden, _runs, compare, per_step
from parity.core import bitwise
from parity.pairs import adapter
from parity.store import checkpoints


def check_checkpoint(pair: adapter.Pair, direction: str) -> None:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  src_name, dst_name = direction.split('->')
  src, dst = runs.side(src_name), runs.side(dst_name)
  *_, state = runs.trajectory(src_name, 'linen')
  with tempfile.TemporaryDirectory() as d:
    manager = checkpoints.open_manager(d)
    checkpoints.save(manager, 1, src, state, runs.dropout_base())
    restored, key = checkpoints.restore(manager, 1, dst)
    manager.close()
  bitwise.assert_bitwise_equal(
      {**src.to_checkpoint(state), 'dropout_base': runs.dropout_base()},
      {**dst.to_checkpoint(restored), 'dropout_base': key},
      f'{pair.name}: checkpoint {direction} (saved vs restored, checkpoint layout)',
  )


def check_resume(pair: adapter.Pair, direction: str) -> None:
  """Train on one side, save half-way, restore into the other, finish: same as never stopping."""
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  src_name, dst_name = direction.split('->')
  src, dst = runs.side(src_name), runs.side(dst_name)
  half = pair.steps // 2
  state = src.from_checkpoint(runs.start('linen'))
  metrics = []
  for step in range(half):
    state, m = src.train_step(state, runs.batch(step), runs.dropout_base())
    metrics.append(dict(m))
  with tempfile.TemporaryDirectory() as d:
    manager = checkpoints.open_manager(d)
    checkpoints.save(manager, half, src, state, runs.dropout_base())
    state, key = checkpoints.restore(manager, half, dst)
    manager.close()
  for step in range(half, pair.steps):
    state, m = dst.train_step(state, runs.batch(step), key)
    metrics.append(dict(m))
  ref_metrics, ref_final, _ = runs.trajectory(src_name, 'linen')
  compare(pair, 'train', {**per_step(ref_metrics), **ref_final}, {**per_step(metrics), **dst.to_checkpoint(state)},
          f'resume {direction} at step {half} vs an uninterrupted {src_name} run',
          labels=(f'uninterrupted {src_name}', f'resumed in {dst_name}'))
