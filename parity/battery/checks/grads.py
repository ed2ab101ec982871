"""The grads part: the loss and every gradient at the common start, bit for bit."""
from __future__ import annotations

import numpy as np

from parity.battery.checks.shared import _battery_frames_hidden, _runs, _unproven_line, _with_localization, compare
from parity.core import paths
from parity.pairs import adapter
from parity.procs import distributed


def check_grads(pair: adapter.Pair) -> list[str]:
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  start = runs.start('linen')
  out = runs.loss_and_grads()
  # Gradients that leave parameters out compare the loss alone there, and pass.
  params = sorted(p for p in start if p.startswith('params/'))
  for name in ('linen', 'nnx'):
    uncovered = [p for p in params if p not in out[name]]
    if uncovered:
      raise AssertionError(
          f'{pair.name}: the {name} side\'s value_and_grads gives no gradient for {len(uncovered)} of the'
          f' {len(params)} parameters ({", ".join(uncovered[:4])}{", ..." if len(uncovered) > 4 else ""}):'
          ' their gradients would not be compared. It returns (loss, {path: gradient}) for every'
          ' parameter, in the checkpoint layout (params/...)')
  try:
    found = compare(pair, 'grads', out['linen'], out['nnx'], 'loss and gradients')
  except AssertionError as e:
    raise _with_localization(pair, e, part='grads') from None
  a, b = (distributed.host_arrays(paths.flatten({k: x for k, x in out[s].items() if k != 'loss'}))
          for s in ('linen', 'nnx'))
  zero = [p for p in sorted(a) if p in b and np.size(a[p]) and not np.any(a[p]) and not np.any(b[p])]
  return found + _unproven_line(zero, 'whose gradient is exactly zero on both sides (step 0; the train'
                                ' part names those no train step moves)')
