"""A side's train step compiled ahead of time, and what XLA says of it: the executable the run
trains with, its lowered text, the comparison lowering the program diff reads, memory and cost
analysis, and the memory of state only NNX keeps taken out."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from parity.compare import programs
from parity.core import paths
from parity.run.verdicts import memory_drift


@dataclasses.dataclass
class CompiledStep:
  """A side's compiled train step and what XLA says about it."""

  executable: jax.stages.Compiled
  text: str  # lowered StableHLO of the program as run
  lower_s: float
  compile_s: float
  # What the program diff reads (see `comparison_lowering`); None when not asked for.
  compared_text: str | None
  argument_names: list[str] | None  # per argument of the compared program's @main
  # Whether `side.comparison_state` changed the state the comparison traces (an allowed
  # difference of `programs.ALLOWED` applied on this side).
  allowed_applied: bool = False
  # The comparison lowering itself (None when not asked for): compiled for `compared_memory`.
  compared_lowered: Any = dataclasses.field(default=None, repr=False)

  def compared_memory(self, device: jax.Device) -> dict[str, Any]:
    """The memory analysis of the program the comparison lowers (state only NNX keeps taken
    out of the step: `StockNnx.comparison_state`), compiled on first use."""
    if self.compared_lowered is None:
      return self.memory(device)
    if not hasattr(self, '_compared_memory'):
      self._compared_memory = memory_of(self.compared_lowered.compile(), device)
    return self._compared_memory

  @property
  def batch_sharding(self) -> Any:
    args, _ = self.executable.input_shardings
    return args[1]

  def memory(self, device: jax.Device) -> dict[str, Any]:
    return memory_of(self.executable, device)

  def cost_flops(self) -> float | None:
    return cost_flops(self.executable)


def compile_step(
    side: Any, state: Any, batch: Any, dropout_base: Any, *, compare_program: bool = True
) -> CompiledStep:
  """The side's train step lowered and compiled, and (`compare_program`) its comparison lowering.

  The comparison lowering traces the step a second time (on
  `side.comparison_state`); a run that compares no programs skips it.
  """
  start = time.perf_counter()
  lowered = side.lower_train_step(state, batch, dropout_base)
  lowered_at = time.perf_counter()
  executable = lowered.compile()
  done = time.perf_counter()
  compared, names, applied, compared_lowered = (
      comparison_lowering(side, state, batch, dropout_base, with_lowered=True) if compare_program
      else (None, None, False, None)
  )
  return CompiledStep(
      executable, lowered.as_text(), lowered_at - start, done - start, compared, names,
      allowed_applied=applied, compared_lowered=compared_lowered,
  )


def state_changed(own: Any, compared: Any) -> bool:
  """Whether `compared` (a side's `comparison_state` of `own`, both abstract) differs from
  `own` in structure, shapes or dtypes: an allowed difference applied."""
  if jax.tree.structure(own) != jax.tree.structure(compared):
    return True
  return any((a.shape, a.dtype) != (b.shape, b.dtype)
             for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(compared)))


def comparison_lowering(side: Any, state: Any, batch: Any, dropout_base: Any,
                        with_lowered: bool = False) -> tuple:
  """The side's train step as the program comparison reads it, its argument names, and
  whether `side.comparison_state` changed the state (`state_changed`).

  Traced on `side.comparison_state` (the allowed differences of
  `programs.ALLOWED` removed there), arguments named by state path.
  """
  # The state keeps its shardings (they are part of the program); the batch
  # and key are placed by the step, as when it runs.
  own = jax.tree.map(_abstract, state)
  compared_state = side.comparison_state(own)
  batch, dropout_base = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (batch, dropout_base)
  )
  # A side may lower it with its modules named on the name stack (as Linen
  # does itself): StockNnx.lower_for_comparison, parity/compare/scopes.py.
  lower = getattr(side, 'lower_for_comparison', side.lower_train_step)
  lowered = lower(compared_state, batch, dropout_base)
  names = side.argument_names(lowered, compared_state, batch, dropout_base)
  out = lowered.as_text(debug_info=True), names, state_changed(own, compared_state)
  return out + (lowered,) if with_lowered else out


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, 'sharding', None))


def program_diff_of(
    linen: CompiledStep, nnx: CompiledStep, opaque_modules: tuple[str, ...] = ()
) -> programs.ProgramDiff:
  """The canonical program diff of two compiled steps, the allowed differences removed.

  `opaque_modules`: module paths whose operations are not compared (see
  `programs.canonicalize`).
  """
  if linen.compared_text is None or nnx.compared_text is None:
    raise ValueError('program_diff_of needs both steps compiled with compare_program=True')
  return programs.diff(
      linen.compared_text, nnx.compared_text,
      linen_args=linen.argument_names, nnx_args=nnx.argument_names,
      allowed=programs.ALLOWED if linen.allowed_applied or nnx.allowed_applied else (),
      opaque_modules=opaque_modules,
  )


def _output_entry_bytes(compiled, output_bytes: int) -> int:
  """What XLA counts per output beyond its data (the output tuple's table), from a step and
  its measured output bytes per device: each output's shard on a device counted as data."""
  leaves = jax.tree.leaves(compiled.executable.out_info)
  shardings = jax.tree.leaves(compiled.executable.output_shardings)
  data = 0
  for x, sharding in zip(leaves, shardings):
    shape = sharding.shard_shape(x.shape) if len(shardings) == len(leaves) else x.shape
    data += paths.data_bytes(jax.ShapeDtypeStruct(shape, x.dtype))
  extra = output_bytes - data
  return extra // len(leaves) if leaves and extra >= 0 and extra % len(leaves) == 0 else 0


def without_nnx_only(account, linen_mem, nnx_mem, linen_compiled, nnx_compiled=None, device=None):
  """NNX's memory analysis without the `nnx_only` state, and the accounting line.

  With NNX's comparison lowering at hand (`nnx_compiled.compared_lowered`), the memory of that
  program: the step with the state taken out as the program part takes it out (its values
  constants, unreturned), so that what a loop carries of it (a layer's RNG streams, drawn from
  and handed back) goes too. Otherwise NNX's analysis less exactly the state's bytes
  (arguments; outputs with their entries in the output table, as measured on Linen's step).
  """
  n, data = len(account['paths']), account['bytes']
  if nnx_compiled is not None and nnx_compiled.compared_lowered is not None:
    adjusted = nnx_compiled.compared_memory(device)
    full = ', '.join(memory_drift(adjusted, nnx_mem)) or 'no byte'
    line = (f'state only NNX keeps ({n} leaves, {data:,} B: {", ".join(account["paths"])}): NNX\'s step'
            f' compared without it, as the program part compares it (it adds {full} to the step'
            ' that carries it)')
    return adjusted, [line]
  entry = _output_entry_bytes(linen_compiled, linen_mem['output_bytes'])
  adjusted = dict(nnx_mem)
  adjusted['argument_bytes'] -= data
  adjusted['output_bytes'] -= data + n * entry
  adjusted['peak_bytes'] = (adjusted['argument_bytes'] + adjusted['output_bytes'] + adjusted['temp_bytes']
                            - adjusted['alias_bytes'])
  line = (f'state only NNX keeps ({n} leaves, {data:,} B: {", ".join(account["paths"])}): NNX arguments'
          f' less {data:,} B, outputs less {data + n * entry:,} B ({data:,} B and {n} x {entry} B of the'
          f' output table, as on Linen\'s step); every other byte accounted')
  return adjusted, [line]


def memory_of(executable: jax.stages.Compiled, device: jax.Device) -> dict[str, Any]:
  """XLA's memory analysis of a compiled program, per device, in bytes.

  `peak_bytes` = arguments + outputs + temporaries - aliased (donated)
  buffers; `percent` relates it to the device's memory limit where the
  device reports one (accelerators; not the CPU).
  """
  try:
    analysis = executable.memory_analysis()
  except Exception:  # not every backend implements it
    analysis = None
  if analysis is None:
    return {}
  fields = {
      'argument_bytes': 'argument_size_in_bytes',
      'output_bytes': 'output_size_in_bytes',
      'temp_bytes': 'temp_size_in_bytes',
      'alias_bytes': 'alias_size_in_bytes',
      'generated_code_bytes': 'generated_code_size_in_bytes',
  }
  out = {key: int(getattr(analysis, attr, 0) or 0) for key, attr in fields.items()}
  out['peak_bytes'] = (
      out['argument_bytes'] + out['output_bytes'] + out['temp_bytes'] - out['alias_bytes']
  )
  try:
    limit = (device.memory_stats() or {}).get('bytes_limit')
  except Exception:
    limit = None
  out['device_bytes_limit'] = int(limit) if limit else None
  out['percent'] = 100.0 * out['peak_bytes'] / limit if limit else None
  return out


def cost_flops(executable: jax.stages.Compiled) -> float | None:
  """FLOPs by XLA's cost analysis (older jax returns one dict per program)."""
  try:
    analysis = executable.cost_analysis()
  except Exception:
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if not analysis or 'flops' not in analysis:
    return None
  return float(analysis['flops'])
