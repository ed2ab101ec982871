"""The train part: the trajectory of train steps from either side's init, bit for bit."""
from __future__ import annotations

from parity.battery.checks.shared import _battery_frames_hidden, _runs, _unproven_line, _with_localization, compare, first_divergent_step, per_step
from parity.core import bitwise
from parity.pairs import adapter
from parity.procs import distributed


def check_train(pair: adapter.Pair, init_side: str) -> list[str]:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  (ma, fa, _), (mb, fb, _) = (runs.trajectory(s, init_side) for s in ('linen', 'nnx'))
  try:
    found = compare(pair, 'train', {**per_step(ma), **fa}, {**per_step(mb), **fb},
                    f'{pair.steps} train steps from {init_side} init (train metrics, final state)')
  except AssertionError as e:
    step = first_divergent_step(ma, mb)
    metric_diffs = bitwise.compare_trees(dict(ma[step]), dict(mb[step]))
    raise _with_localization(pair, e, step, init_side, metric_diffs) from None
  start = runs.start(init_side)
  params = [p for p in sorted(start) if p.startswith('params/') and p in fa and p in fb]
  start, a, b = (distributed.host_arrays({p: f[p] for p in params}) for f in (start, fa, fb))
  still = [p for p in params if bitwise.compare_leaves(p, start[p], a[p]) is None
           and bitwise.compare_leaves(p, start[p], b[p]) is None]
  return found + _unproven_line(still, f'that {pair.steps} train step(s) leave bit for bit as they started, on'
                                ' both sides (their gradients zero on every step, or the optimizer leaves them)')
