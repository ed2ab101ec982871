"""The XLA flags a run needs, set in the environment before jax starts.

Four needs, each named here:

* **Portable CPU numerics** (`portable_cpu_flags()`). By default XLA:CPU picks
  code by host: the YNNPACK kernels it fuses dots into are chosen per CPU,
  it emits AVX-512 where the host has it, it uses platform-specific math
  approximations, and Eigen may split a contraction over as many threads as
  the host has cores. Each changes loss bits between machines (measured:
  the golden loss records of one CPU failed on another from step 1 or 2
  on). With these flags the per-step losses are the same bits on an AMD
  EPYC (AVX-512, avx512_bf16), on the same machine pinned to one core, and
  under qemu's Intel Haswell model (another vendor, cache sizes and no
  AVX-512) for every scenario but 05_fp8, which leaves its record there
  from step 2 because qemu flushes float16 denormals that the F16C
  conversions keep on x86 CPUs by Intel's manual (tests/test_scenarios.py).
  The jax 0.11 records, written on the AMD EPYC, held on a 16-core Intel
  Xeon (AVX-512, AMX) for every scenario, 05_fp8 too; the jax 0.10 and 0.12
  records held on a 2-core Intel Xeon (AVX-512 with FP16, AMX), where the
  whole suite passed on Python 3.11 and 3.12. A compilation cache written on
  the AMD EPYC (jax 0.10) also served a run on that Xeon (jax's cache key
  names no CPU), and that run passed, the records included. Any x86-64 CPU with
  AVX2 and FMA runs them; the suite and the golden records use them. On
  aarch64 the instruction-set cap is NEON instead, XLA's own default there:
  the x86 value, which an earlier version set on every host, filters nothing
  on ARM and so lifted XLA's cap, letting LLVM emit SVE, which XLA's source
  says it lacks lowerings for (read in xla/debug_options_flags.cc and
  xla/backends/cpu/codegen/cpu_features.cc; not run: no ARM host was at
  hand). The loss records are x86 bits and are skipped off x86-64
  (tests/test_scenarios.py). Not covered: runs on ARM, and real second CPUs
  beyond these.
* **Deterministic GPU** (`GPU_DETERMINISTIC_FLAGS`): XLA:GPU's scatter and
  reduction kernels may add in a different order on every run (atomics,
  autotuned algorithms); bitwise runs on a GPU need them off. Reported from
  an H100 run (jax 0.11): without the flag `08_bf16_weights` and
  `09_tied_logits` diverge across sides, with it they are bit-identical.
  Measured with it on one H100 (jax 0.11.2): every scenario of the tiny
  preset bit-identical over 10 steps, and the hardware tier passes.
  The flag is read only by the GPU backend.
* **CPU devices for a mesh** (`host_device_count_flag`): jax on CPU has one
  device unless told before it starts.
* **The CPU client's thread count** (`CPU_THREADS_ENV`). XLA:CPU splits a
  large elementwise loop into as many parallel tasks as the CPU client has
  threads (the larger of `PJRT_NPROC`, or the host's cores, and the CPU
  device count), and the split changes loss bits for some programs: with one
  device on 2 cores, 02_unscanned and 06_grad_accum round otherwise than with
  8 devices (measured here; 8, 12, 16, 32 and 64 devices gave the records'
  bits). The suite's 8 devices and `PJRT_NPROC=8` make it 8 on every host.
  Loops XLA judges memory-bound are split by the square root of the host's
  cores whatever the setting; 1 and 2 cores gave the same bits (02_unscanned).

Nothing here imports jax: these must be set before it is imported.

Tried for the suite's compile time and not used (measured on a 2-core AMD
EPYC, jax 0.10.2; a tiny-preset train step compiles in 2.9 s by default):

* `--xla_backend_optimization_level=0` (LLVM unoptimised): 1.5 s, and the
  same optimised HLO and memory analysis as a default compile. A cold suite
  took 333 s instead of 499 s, but a warm one 161 s instead of 116 s (the
  unoptimised code runs slower), and the loss bits change, so the
  golden records would too. It also splits two programs that are bitwise
  equal under the default code generation: the `full` and `save_dots` remat
  policies differ from step 2 (test_scenarios.test_remat_policies_agree).
* The same with XLA:CPU's loop emitters (`--xla_cpu_use_fusion_emitters=false`):
  0.5 s, a cold suite in 219 s. These emitters change XLA's fusion, and the
  encoder family, whose two stock layer norms lower to different HLO, then
  rounds its loss otherwise on the two sides from step 2 or 3, counted
  from 0, by 1 ULP (bitwise under the default code generation). The
  reference decoder's sides stayed bitwise under both settings.
* `--xla_backend_optimization_level=1` (LLVM -O1; Python 3.11, against a default run
  of the same clean clone that day): a cold suite took 347 s instead of 433 s and a
  warm one 115 s instead of 119 s, and both sides stayed bit-identical in
  every test; but the losses of 06_grad_accum from step 4 and
  09_tied_logits from step 7 change (by 1 or 2 ULP at first), and with
  jax 0.12 (Python 3.12) 9 of the 11 scenarios' losses change. The records
  would all be taken again, and their portability (checked under qemu with
  the default) would be unchecked.
* `--xla_llvm_disable_expensive_passes=true` and
  `--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE` (jax 0.10.2): the
  tiny-preset train steps compiled in the same time as by default (2.44 s
  and 2.41 s against 2.45 s and 2.40 s). In a profile of such a compile, HLO
  passes took about 0.1 s; LLVM's IR passes, its machine-code emission and
  the MLIR fusion emitters took most of the rest.
* No change either (jax 0.10.2; the Linen and NNX 01_baseline train steps,
  2.44 to 2.49 s by default, 2.43 to 2.63 s with each):
  `--xla_cpu_parallel_codegen_split_count=1`,
  `--xla_llvm_enable_{alias_scope,noalias,invariant_load}_metadata=false`,
  `--xla_cpu_prefer_vector_width=128`, `--xla_cpu_use_thunk_runtime=false`,
  `--xla_cpu_experimental_enable_tiling_propagation=false`,
  `--xla_cpu_copy_insertion_use_region_analysis=false`,
  `--xla_cpu_enable_concurrency_optimized_scheduler=false`. The loop
  emitters without `-O0` made them slower (6.1 and 7.3 s), and jax 0.12 no
  longer knows `--xla_cpu_use_fusion_emitters`.
* XLA:CPU's backend options (`--xla_backend_extra_options=NAME`; jax 0.10.2
  on another, slower 2-core AMD EPYC, timing the backend compiles of 10
  Linen train steps, the step and the small programs around it: 8.4, 10.2
  and 9.5 s by default for 01_baseline, 06_grad_accum and 09_tied_logits):
  `xla_cpu_disable_loop_unrolling` took 6.5, 9.2 and 6.6 s, but their
  losses leave the records from step 0, 2 and 1 (the cause not traced), so
  every record would be taken again; `xla_cpu_optimize_for_size` changed
  the bits too and saved nothing; `xla_cpu_disable_slp_vectorizer` kept the bits and saved
  nothing beyond the machine's spread (8.5, 9.6 and 7.6 s). The flags
  `--xla_cpu_disable_loop_unrolling` and the like do not exist: XLA stops
  at an unknown flag.
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Iterable, MutableMapping

# The widest instruction set XLA:CPU may emit, per host architecture: the common
# ground of that architecture's servers. x86-64: AVX2 + FMA (measured: AVX-512 code
# gives other loss bits from step 1 on). aarch64: NEON, XLA's own default there
# (`DefaultMaxIsa` in xla/debug_options_flags.cc, for the SVE lowerings LLVM
# lacks); an x86 value on an ARM host filters nothing and would lift that cap.
MAX_ISA_FLAGS: dict[str, str] = {
    'x86_64': '--xla_cpu_max_isa=AVX2',
    'amd64': '--xla_cpu_max_isa=AVX2',
    'aarch64': '--xla_cpu_max_isa=NEON',
    'arm64': '--xla_cpu_max_isa=NEON',
}

# The flags of portable numerics every architecture takes.
PORTABLE_CPU_MATH_FLAGS: tuple[str, ...] = (
    # Dots, fused elementwise ops and reductions in XLA's own code, not in
    # YNNPACK/XNNPACK kernels chosen per CPU model.
    '--xla_cpu_experimental_ynn_fusion_type=',
    '--xla_cpu_use_xnnpack=false',
    # exp, log, rsqrt, tanh by XLA's portable polynomials.
    '--xla_cpu_enable_platform_dependent_math=false',
    # One thread per contraction: the split of a dot's reduction dimension
    # otherwise follows the host's core count.
    '--xla_cpu_multi_thread_eigen=false',
)


def portable_cpu_flags(machine: str | None = None) -> tuple[str, ...]:
  """The portable CPU numerics for a host (`platform.machine()` by default).

  On x86-64 these are the flags the golden loss records were taken with. On
  another architecture the instruction-set cap is that architecture's own
  (none where MAX_ISA_FLAGS names none), never an x86 one.
  """
  machine = (platform.machine() if machine is None else machine).lower()
  isa = MAX_ISA_FLAGS.get(machine)
  return ((isa,) if isa else ()) + PORTABLE_CPU_MATH_FLAGS


GPU_DETERMINISTIC_FLAGS: tuple[str, ...] = ('--xla_gpu_deterministic_ops=true',)

SUITE_CPU_DEVICES = 8

# Read by the PjRt CPU client when it starts: its thread count instead of the host's cores.
CPU_THREADS_ENV = 'PJRT_NPROC'


def host_device_count_flag(count: int) -> str:
  return f'--xla_force_host_platform_device_count={count}'


def flag_name(flag: str) -> str:
  return flag.split('=', 1)[0]


def current_flags(environ: MutableMapping[str, str] | None = None) -> list[str]:
  """The flags in `XLA_FLAGS`, in order."""
  environ = os.environ if environ is None else environ
  return environ.get('XLA_FLAGS', '').split()


def add_flags(
    flags: Iterable[str], environ: MutableMapping[str, str] | None = None
) -> list[str]:
  """Appends to `XLA_FLAGS` each flag whose name is not set there yet.

  A flag the user set keeps the user's value. Returns the flags added.
  Refuses once jax has started its backends: XLA reads the flags once.
  """
  environ = os.environ if environ is None else environ
  present = {flag_name(f) for f in current_flags(environ)}
  added = [f for f in flags if flag_name(f) not in present]
  if added and environ is os.environ and backends_started():
    raise RuntimeError(
        f'XLA flags {added} must be set before jax starts its backends; set them in'
        ' XLA_FLAGS before running, or before the first jax computation'
    )
  if added:
    environ['XLA_FLAGS'] = ' '.join(current_flags(environ) + added)
  return added


def backends_started() -> bool:
  """Whether jax (if imported) has created its backends, after which XLA_FLAGS is read."""
  if 'jax' not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge
  except ImportError:  # pragma: no cover - a jax without this module
    return True
  return bool(getattr(xla_bridge, '_backends', None))
