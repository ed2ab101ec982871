"""The portable CPU flags per host architecture (parity/env/xla_env.py; no jax)."""
from __future__ import annotations

from parity.env import xla_env

ISA = '--xla_cpu_max_isa'


def _isa(flags):
  return [f for f in flags if xla_env.flag_name(f) == ISA]


def test_the_instruction_set_cap_is_the_host_architectures_own():
  """AVX2 on x86-64; NEON on ARM, XLA's own default there (an x86 value would lift it);
  none on an architecture without one. The other flags are the same everywhere."""
  assert _isa(xla_env.portable_cpu_flags('x86_64')) == [f'{ISA}=AVX2']
  assert _isa(xla_env.portable_cpu_flags('AMD64')) == [f'{ISA}=AVX2']  # Windows' name
  assert _isa(xla_env.portable_cpu_flags('aarch64')) == [f'{ISA}=NEON']
  assert _isa(xla_env.portable_cpu_flags('arm64')) == [f'{ISA}=NEON']  # macOS' name
  assert _isa(xla_env.portable_cpu_flags('ppc64le')) == []
  for machine in ('x86_64', 'aarch64', 'ppc64le'):
    rest = [f for f in xla_env.portable_cpu_flags(machine) if xla_env.flag_name(f) != ISA]
    assert tuple(rest) == xla_env.PORTABLE_CPU_MATH_FLAGS


def test_the_suite_runs_with_this_hosts_portable_flags():
  """The root conftest.py sets them before jax starts (a flag of the user's own would stay)."""
  flags = xla_env.current_flags()
  assert set(xla_env.portable_cpu_flags()) <= set(flags), flags
