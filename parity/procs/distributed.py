"""The multi-controller side of a run: one process of many, as on a pod host.

`initialize_from_env` joins the run `parity.procs.launcher` started on this
machine (coordinator on the loopback interface), or a run on real hosts
started with the same three environment variables on each (the coordinator
then on host 0's address): CPU collectives over gloo. After it, `jax.devices()` lists every
process's devices and a mesh spans them all.

Batches are assembled from process-local data: each process keeps only its
rows of the global batch (its contiguous block, by process index) and
`jax.make_array_from_process_local_data` makes the global array, as a
per-host input pipeline does. Values read back on the host are either
replicated or gathered from every process (`host_arrays`).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import numpy as np

from parity.core import compat
from parity.procs import launcher


def env_process() -> tuple[str, int, int] | None:
  """(coordinator, process count, process index) from the environment, or None."""
  if launcher.PROCESS_ID not in os.environ:
    return None
  return (
      os.environ[launcher.COORDINATOR],
      int(os.environ[launcher.NUM_PROCESSES]),
      int(os.environ[launcher.PROCESS_ID]),
  )


def initialize_from_env() -> bool:
  """Joins the multi-process run described by the environment; False if there is none."""
  found = env_process()
  if found is None:
    return False
  coordinator, count, index = found
  on_this_machine = coordinator.startswith(launcher.LOOPBACK + ':')  # started by parity.procs.launcher
  # CPU collectives between processes (accelerators use their own interconnect).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # A precaution: executables compiled under a multi-process runtime are kept
  # apart from single-process ones in jax's persistent cache (one directory
  # per process count), so no run ever loads another runtime's executable.
  cache_dir = jax.config.jax_compilation_cache_dir
  if cache_dir:
    jax.config.update('jax_compilation_cache_dir', os.path.join(cache_dir, f'processes-{count}'))
    if on_this_machine:
      # Every process on this machine, one cache directory: each process
      # keeps its own compiles (jax keeps process 0's only; see compat).
      compat.cache_compiles_of_every_process()
  if on_this_machine:
    # The launcher stops the other processes of a failed run with SIGTERM.
    # jax's preemption service (on by default) catches SIGTERM as a notice
    # to reach a preemption sync point and goes on running; parity has no
    # such point, so a process kept running until the launcher's SIGKILL
    # after its grace period (measured: 5 s longer for every failed run).
    # Off for runs on this machine: SIGTERM then ends a process at once.
    jax.config.update('jax_enable_preemption_service', False)
  jax.distributed.initialize(coordinator, num_processes=count, process_id=index)
  return True


def process_rows(global_rows: int, index: int | None = None, count: int | None = None) -> slice:
  """This process's contiguous block of the batch rows."""
  index = jax.process_index() if index is None else index
  count = jax.process_count() if count is None else count
  if global_rows % count:
    raise ValueError(f'a batch of {global_rows} rows does not split over {count} processes')
  per = global_rows // count
  return slice(index * per, (index + 1) * per)


def global_batch(host_batch: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
  """The global batch from this process's rows only (its block by process index)."""
  out = {}
  for key, full in host_batch.items():
    rows = process_rows(full.shape[0])
    _check_rows(sharding, full.shape, rows)
    out[key] = jax.make_array_from_process_local_data(sharding, np.asarray(full[rows]), full.shape)
  return out


def _check_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...], rows: slice) -> None:
  """The rows this process supplies must be the rows its devices hold."""
  held = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    r = index[0]
    held.update(range(r.start or 0, shape[0] if r.stop is None else r.stop))
  if held != set(range(rows.start, rows.stop)):
    raise ValueError(
        f'process {jax.process_index()} supplies batch rows {rows.start}..{rows.stop - 1}'
        f' but its devices hold rows {sorted(held)}: the batch axis of the mesh must list'
        ' each process\'s devices together'
    )


def replicated(x: Any, mesh: jax.sharding.Mesh) -> jax.Array:
  """`x` (the same on every process) as an array replicated over `mesh`."""
  return jax.device_put(np.asarray(x), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def host_arrays(flat: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Every array whole on this host: gathered from all processes where it spans them."""
  from jax.experimental import multihost_utils

  out = {}
  for path, x in flat.items():
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      out[path] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    else:
      out[path] = np.asarray(x)
  return out
