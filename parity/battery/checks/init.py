"""The init part: each side's own initialisation, compared in distribution (INIT_SIGMAS)."""
from __future__ import annotations

import jax
import numpy as np

from parity.battery.checks.shared import _battery_frames_hidden, _runs
from parity.core import bitwise
from parity.pairs import adapter
from parity.procs import distributed


# The init part's bound: the two sides draw their random initialisers from different
# keys (Linen folds module paths into the key, NNX counts a stream), so random leaves
# are compared in distribution, at 6 standard errors (a false alarm about 1e-9 per leaf).
INIT_SIGMAS = 6


def check_init(pair: adapter.Pair) -> None:
  """Each side's own initial state (`init(pair.seed)`, checkpoint layout) against the other's.

  The rest of the battery starts both sides from one state, so a different
  initialiser passes it. Here every leaf that is not random on both sides
  (zeros, ones, a step counter: all its elements equal on either side, or
  not floats) must be bitwise equal; a leaf random on both sides, with n
  elements of standard deviation s, must agree in distribution:
  |mean_linen - mean_nnx| <= 6 s sqrt(2/n) and |std_linen / std_nnx - 1| <= 6/sqrt(n),
  6 standard errors of the difference. A wrong scale (fan-out for fan-in, a
  forgotten 1/sqrt(d)) is caught where it moves the std by more than 6/sqrt(n)
  (0.19 for 1,000 elements, 0.06 for 10,000); initialisers of one variance
  but another shape (uniform against truncated normal) are not told apart.
  """
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  a = distributed.host_arrays(runs.start('linen'))
  b = distributed.host_arrays(runs.start('nnx'))
  problems = []
  for d in bitwise.compare_trees(a, b):
    if d.kind != 'bits':
      problems.append(str(d))
      continue
    x, y = a[d.path], b[d.path]
    random = [is_random(v) for v in (x, y)]
    if not all(random):
      which = ' and '.join(name for name, r in zip(('Linen', 'NNX'), random) if not r)
      problems.append(f'{d} (not random in {which}: all its elements equal, or not floats, so'
                      ' compared bit for bit)')
      continue
    x, y = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    problem = distribution_problem(d.path, (x.size, x.mean(), x.std()), (y.size, y.mean(), y.std()))
    if problem:
      problems.append(problem)
  if problems:
    raise AssertionError(
        f'{pair.name}: the two sides\' own initial states (init(seed {pair.seed}), checkpoint'
        f' layout) differ beyond what their random initialisers explain: {len(problems)}'
        ' leaf/leaves (values: Linen vs NNX)\n  ' + '\n  '.join(problems[:50])
        + (f'\n  ... and {len(problems) - 50} more' if len(problems) > 50 else '')
    )


def distribution_problem(path: str, a: tuple[int, float, float], b: tuple[int, float, float]) -> str:
  """Why two random leaves of (elements, mean, std) `a` and `b` are not one distribution at
  INIT_SIGMAS standard errors ('' where they are); a record keeps a leaf's statistics alone."""
  (n, mx, sx), (_, my, sy) = a, b
  mean_bound = INIT_SIGMAS * max(sx, sy) * np.sqrt(2 / n)
  std_bound = INIT_SIGMAS / np.sqrt(n)
  stats = (f'mean {mx:.4g} vs {my:.4g}, std {sx:.4g} vs {sy:.4g}, {n} elements;'
           f' bounds: means within {mean_bound:.3g}, std ratio within 1 +- {std_bound:.3g}')
  if abs(mx - my) > mean_bound or abs(sx / sy - 1) > std_bound:
    return f'{path}: another distribution ({stats})'
  return ''


def is_random(v: np.ndarray) -> bool:
  """Whether a leaf is compared in distribution: floats whose elements are not all equal."""
  return jax.numpy.issubdtype(v.dtype, jax.numpy.floating) and v.size > 1 and bool(np.any(v != v.flat[0]))
