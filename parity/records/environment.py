"""What determines a record's bits: the platform and devices, the versions and the XLA flags, and
on the CPU the instruction-set features XLA compiles for (shared data: one program gave other
loss bits on CPUs of other features, and under `--xla_cpu_max_isa`)."""
from __future__ import annotations

import os
import platform as platform_lib
from typing import Any, Mapping

# The CPU features XLA:CPU's code generation reads (vector widths, FMA, bf16 and AMX units):
# two CPUs that differ in one of them may round a program otherwise.
CPU_FEATURES = ('avx', 'avx2', 'fma', 'f16c', 'avx512f', 'avx512bw', 'avx512dq', 'avx512vl',
                'avx512_vnni', 'avx512_bf16', 'avx512_fp16', 'avx_vnni', 'amx_tile', 'amx_bf16', 'amx_int8',
                'asimd', 'sve', 'sve2', 'bf16', 'i8mm')

# The fields, in the order a refusal names them.
FIELDS = ('platform', 'device_kind', 'device_count', 'jax', 'jaxlib', 'flax', 'xla_flags', 'cpu_features')


def _cpu_features() -> list[str]:
  """The features of `CPU_FEATURES` this CPU has (Linux's /proc/cpuinfo); the machine name elsewhere."""
  try:
    with open('/proc/cpuinfo') as f:
      text = f.read()
  except OSError:
    return [f'unknown ({platform_lib.machine()})']
  flags: set[str] = set()
  for line in text.splitlines():
    name, _, value = line.partition(':')
    if name.strip() in ('flags', 'Features'):
      flags |= set(value.split())
  return [f for f in CPU_FEATURES if f in flags]


def current() -> dict[str, Any]:
  """This process's environment, as a record stores it."""
  import flax
  import jax
  import jaxlib

  device = jax.devices()[0]
  env = {
      'platform': device.platform,
      'device_kind': device.device_kind,
      'device_count': jax.device_count(),
      'jax': jax.__version__,
      'jaxlib': jaxlib.__version__,
      'flax': flax.__version__,
      'xla_flags': sorted(os.environ.get('XLA_FLAGS', '').split()),
  }
  if device.platform == 'cpu':
    env['cpu_features'] = _cpu_features()
  return env


def differences(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
  """Each field in which `here` is not the environment `recorded` was taken in, both values named."""
  out = []
  for field in FIELDS:
    a, b = recorded.get(field), here.get(field)
    if a == b:
      continue
    if field in ('xla_flags', 'cpu_features') and isinstance(a, list) and isinstance(b, list):
      only_a, only_b = [x for x in a if x not in b], [x for x in b if x not in a]
      out.append(f'{field}: recorded with {" ".join(only_a) or "nothing more"}, here'
                 f' {" ".join(only_b) or "nothing more"}')
    else:
      out.append(f'{field}: recorded {a!r}, here {b!r}')
  return out
