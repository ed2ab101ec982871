"""Repository-wide pytest set-up: the XLA environment, before anything imports jax.

* The CPU battery runs on 8 CPU devices (the mesh tests need them) and 8
  CPU-client threads with the portable CPU numerics of `parity.env.xla_env`, so
  that exact-bit records hold on x86-64 hosts with AVX2 whatever their core
  count, and on other CPU models as far as measured (parity/env/xla_env.py).
* It runs on the CPU devices whatever the default backend is: on a GPU or TPU
  host the plain `pytest -n auto` still runs the CPU battery (the processes
  its tests start too), and xdist workers do not preallocate accelerator
  memory. Only the hardware tier
  (`pytest -m hardware`, or its alias `-m tpu`) uses the accelerator, with
  the deterministic GPU flags set here.
* Python's garbage collector runs less often while the workers trace
  (parity/env/gc_tuning.py).

pytest-xdist workers import this file too, so they get the same environment.
"""
import getpass
import os
import tempfile

import pytest

from parity.env import gc_tuning
from parity.env import xla_env

xla_env.add_flags(
    (xla_env.host_device_count_flag(xla_env.SUITE_CPU_DEVICES),)
    + xla_env.portable_cpu_flags()
    + xla_env.GPU_DETERMINISTIC_FLAGS
)
# XLA:CPU splits large loops into one task per CPU-client thread, and the split
# can change bits (parity/env/xla_env.py): 8 threads on every host, as with 8 devices.
os.environ.setdefault(xla_env.CPU_THREADS_ENV, str(xla_env.SUITE_CPU_DEVICES))
# Each xdist worker is a process; preallocation would give the first one most
# of the accelerator's memory and the others none.
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

# jax's persistent compilation cache, shared by the xdist workers and the
# processes tests start (they all inherit this environment): a program
# compiled by one test (or worker, or an earlier run) is loaded, not compiled
# again. The cache is keyed by the program, jax version and flags, so a hit is
# the same executable, bit for bit. Set JAX_COMPILATION_CACHE_DIR to use
# another directory. (One directory per worker, tried once, missed most
# entries on the next run: xdist sends a group to whichever worker is free.)
os.environ.setdefault(
    'JAX_COMPILATION_CACHE_DIR',
    os.path.join(tempfile.gettempdir(), f'linen-nnx-parity-jax-cache-{getpass.getuser()}'),
)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
# A size limit turns on jax's file lock around every cache read and write
# (jax writes an entry in place, so without it a reader can see half an entry).
# 8 GiB is far above the suite's use (about 0.1 GiB).
os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(8 * 2**30))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

# Fewer garbage collections while tracing (parity/env/gc_tuning.py: about 8 % of the warm suite).
gc_tuning.tune()

HARDWARE_MARKERS = ('hardware', 'tpu')  # `tpu` is the tier's older name, kept as an alias


def pytest_addoption(parser):
  group = parser.getgroup('parity')
  group.addoption(
      '--hardware-on-cpu', '--tpu-on-cpu', dest='hardware_on_cpu', action='store_true',
      default=False,
      help='run the hardware tier on the CPU devices with the tiny preset (no accelerator'
           ' needed; --tpu-on-cpu is its older name)',
  )
  group.addoption(
      '--exhaustive', action='store_true', default=False,
      help='run the exhaustive tier too (tests/tiers.py): every decoder scenario, mesh and'
           ' multi-process run, the CLI end to end and the notebook. Without it a run of the'
           ' whole suite (no path, -m or -k given) runs the core tier; `make test-all` and CI pass it',
  )
  group.addoption(
      '--full-mesh-matrix', action='store_true', default=False,
      help='train every scenario on every mesh (default: tests/runs.py mesh_cases: the'
           ' baseline on every mesh, the others on the 3-axis mesh but two, gradient'
           ' accumulation on fsdp=8 too)',
  )


def hardware_tier_selected(config) -> bool:
  """True when `-m` asks for the hardware tier (`-m hardware`, `-m tpu`, `-m "hardware and ..."`)."""
  expr = config.getoption('markexpr', '') or ''
  words = expr.replace('(', ' ').replace(')', ' ').split()
  return any(
      word in HARDWARE_MARKERS and (i == 0 or words[i - 1] != 'not')
      for i, word in enumerate(words)
  )


def pytest_configure(config):
  if not hardware_tier_selected(config):
    # The CPU battery: CPU devices whatever the default backend, in the processes
    # tests start too (a conversion, the notebook's kernel, `parity compare`).
    assert not xla_env.backends_started(), 'jax started before the suite chose its platform'
    os.environ['JAX_PLATFORMS'] = 'cpu'
    import jax

    jax.config.update('jax_platforms', 'cpu')


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  """pytest-xdist's hook as it starts a worker: the tier the main process chose (tests/tiers.py)."""
  from tests import tiers

  node.workerinput[tiers.WORKER_INPUT] = tiers.core_only(node.config)


def pytest_report_header(config):
  from tests import tiers

  if tiers.core_only(config):
    return ['tier: core (the exhaustive tier is deselected: `make test-all` or --exhaustive runs it;'
            ' tests/tiers.py says what each holds)']
  return ['tier: ' + ('core and exhaustive' if config.getoption('exhaustive')
                      else 'both, as far as the paths, -m or -k select')]


def accelerator_platform() -> str | None:
  """'tpu' or 'gpu' when jax's default backend is an accelerator, else None."""
  import jax

  backend = jax.default_backend()
  return backend if backend in ('tpu', 'gpu') else None


def pytest_collection_modifyitems(config, items):
  """The hardware tier runs on an accelerator under `-m hardware`, or on the CPU devices
  with `--hardware-on-cpu`; otherwise it is skipped, with the reason."""
  tier = [item for item in items if any(item.get_closest_marker(m) for m in HARDWARE_MARKERS)]
  for item in tier:  # one tier, either name selects it
    for marker in HARDWARE_MARKERS:
      if not item.get_closest_marker(marker):
        item.add_marker(marker)
  if not tier or config.getoption('hardware_on_cpu'):
    return
  if hardware_tier_selected(config):
    if accelerator_platform():
      return
    reason = ('hardware tier: no accelerator (TPU or GPU) here; add --hardware-on-cpu to run'
              ' the same tests on the CPU devices with the tiny preset')
  else:
    reason = ('hardware tier: runs on an accelerator host with `pytest -m hardware`, or on'
              ' the CPU devices with --hardware-on-cpu (which `make test` passes)')
  for item in tier:
    item.add_marker(pytest.mark.skip(reason=reason))
