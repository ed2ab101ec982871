"""Python's garbage collector, tuned for processes that trace many jax programs.

Tracing and lowering a train step allocate hundreds of thousands of small
Python objects (jaxpr equations, tracers, MLIR wrappers), and a jax process
keeps a large heap of long-lived ones (jax, flax, optax and orbax, the
traced and cached programs). With Python's default thresholds (700, 10, 10)
the collector runs thousands of times per test worker, and each full
collection walks that whole heap. Measured on a 2-core machine, Python 3.11,
warm compilation cache, the whole suite in two interleaved pairs of runs:
with the defaults the two workers spent 23 to 24 s collecting (about 15,000
young and 50 full collections) and the suite took 139 s and 138 s; with
`THRESHOLDS` 4 s (about 700 and 3) and 124 s and 130 s. From an empty
cache, where compiling dominates, three interleaved pairs differed by +34,
+12 and -38 s: nothing beyond the machine's spread. Python 3.12, the
decoder's battery alone: 25.7 s against 22.9 s. The `parity` command keeps
Python's defaults: a warm 2-process `parity compare` took as long with these.

Nothing else changes: objects are freed by reference counting as before, and
the collector still finds every cycle, later (a worker's peak resident
memory, decoder battery and program parity: 1.93 GB against 1.89 GB).
Numerics are not involved.
"""
from __future__ import annotations

import gc

# (young objects allocated before a young collection, young collections per
# middle one, middle ones per full one); Python's defaults are (700, 10, 10).
THRESHOLDS = (10_000, 50, 50)


def tune() -> None:
  """Raises this process's thresholds to `THRESHOLDS`.

  A threshold already set higher is kept, and so is a collector turned off
  by a first threshold of 0.
  """
  current = gc.get_threshold()
  if current[0] == 0:
    return
  gc.set_threshold(*(max(c, t) for c, t in zip(current, THRESHOLDS)))
