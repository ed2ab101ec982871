"""Repository-wide pytest set-up.

On CPU, jax must see 8 virtual devices so mesh tests run here. The flag is
set at import time, before anything imports jax; pytest-xdist workers import
this file too, so they get the same devices.
"""
import getpass
import os
import tempfile

_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()

# jax's persistent compilation cache, shared by the xdist workers (they inherit
# this environment): a program compiled by one test (or worker, or an earlier
# run) is loaded, not compiled again. The cache is keyed by the program, jax
# version and flags, so a hit is the same executable, bit for bit. Set
# JAX_COMPILATION_CACHE_DIR to use another directory.
os.environ.setdefault(
    'JAX_COMPILATION_CACHE_DIR',
    os.path.join(tempfile.gettempdir(), f'linen-nnx-parity-jax-cache-{getpass.getuser()}'),
)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')


def pytest_addoption(parser):
  group = parser.getgroup('parity')
  group.addoption(
      '--tpu-on-cpu', action='store_true', default=False,
      help='run the `tpu` tier on the CPU devices with the tiny preset (no TPU needed)',
  )
  group.addoption(
      '--full-mesh-matrix', action='store_true', default=False,
      help='train every scenario on every mesh (default: every scenario on the 3-axis'
           ' mesh, and baseline, dropout and gradient accumulation on every mesh)',
  )


def _has_tpu() -> bool:
  import jax

  try:
    return bool(jax.devices('tpu'))
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  """`tpu` tests run on a TPU host, or on the CPU devices with `--tpu-on-cpu`."""
  tier = [item for item in items if item.get_closest_marker('tpu')]
  if not tier or config.getoption('--tpu-on-cpu') or _has_tpu():
    return
  import pytest

  skip = pytest.mark.skip(
      reason='tpu tier: no TPU on this host; run `pytest -m tpu` on a TPU VM, or add'
      ' --tpu-on-cpu to run the same tests on the CPU devices with the tiny preset'
  )
  for item in tier:
    item.add_marker(skip)
