"""The side-by-side runner: both implementations trained from one state.

One side is initialised, its state is carried to the other through the
bridge's checkpoint layout, then both train on the same batches with the
same dropout base key. Losses are compared by their bits each step; final
parameters and optimizer state are compared bitwise at the end.

How steps are timed:

- Each side's train step is lowered and compiled ahead of time
  (`.lower(...).compile()`), timed apart as `compile_s`; step 0 then only
  executes, so it is a step time like any other.
- A step's time is the interval from its dispatch, made right after the
  previous host synchronisation, to the host synchronisation on that step's
  loss (the loss read back as a number). The time between two asynchronous
  dispatches is never used: it measures the dispatch, not the step.
- The two sides' steps are interleaved, and which side goes first alternates
  every step, so machine noise and cache effects hit both alike.
- A checkpoint save happens after both sides' losses of that step are on the
  host (and reported through `on_step`), and it is timed apart, until the
  checkpoint is committed: no save overlaps a timed step, no step contains one.

The compiled programs also give what the report needs: XLA's memory analysis
(argument, output, temporary bytes), its cost analysis (FLOPs), and the
lowered text of both train steps for `parity.compare.programs.diff`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from parity.core import paths, rng
from parity.pairs import adapter
from parity.core import bitwise
from parity.procs import distributed
from parity.compare import placement
from parity.compare import programs

SIDES = ('linen', 'nnx')


@dataclasses.dataclass
class SideRun:
  losses: list[float] = dataclasses.field(default_factory=list)
  loss_hex: list[str] = dataclasses.field(default_factory=list)
  # Seconds per step, step 0 included (compilation is not in it: compile_s).
  step_times: list[float] = dataclasses.field(default_factory=list)
  # (dispatch, loss on host) of each step, seconds since the run's first step.
  step_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  lower_s: float | None = None  # tracing and lowering to StableHLO
  compile_s: float | None = None  # lowering plus XLA compilation
  checkpoint_steps: list[int] = dataclasses.field(default_factory=list)
  checkpoint_s: list[float] = dataclasses.field(default_factory=list)  # until committed
  checkpoint_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  memory: dict[str, Any] = dataclasses.field(default_factory=dict)
  xla_flops: float | None = None  # XLA's cost analysis of the compiled step (per device)

  @property
  def avg_step_s(self) -> float | None:
    """Mean step time; step 0 left out when there are later steps (first-run effects)."""
    times = self._timed_steps
    return float(np.mean(times)) if times else None

  @property
  def median_step_s(self) -> float | None:
    """Median step time, of the steps the mean takes."""
    times = self._timed_steps
    return float(np.median(times)) if times else None

  @property
  def _timed_steps(self) -> list[float]:
    return self.step_times[1:] or self.step_times


@dataclasses.dataclass
class DecodeRun:
  """Both sides decoding after training: times (synchronised on the tokens) and what differs."""

  steps: int
  prompt_len: int
  temperature: float
  # Per side: seconds of a decode of one token (the prefill and one draw), and of `steps` tokens.
  prefill_s: dict[str, float] = dataclasses.field(default_factory=dict)
  total_s: dict[str, float] = dataclasses.field(default_factory=dict)
  diffs: list[str] = dataclasses.field(default_factory=list)  # bitwise.compare_trees lines
  first_differing_step: int | None = None
  # One decoding step's program (sides with `lower_decode_step`; else empty / None):
  # XLA's memory analysis per side, and the canonical program diff.
  memory: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  program: programs.ProgramDiff | None = None
  program_not_compared: str = 'not compared (a side gives no lower_decode_step)'  # why, where None

  @property
  def memory_drift(self) -> list[str]:
    return memory_drift(self.memory['linen'], self.memory['nnx']) if self.memory else []

  @property
  def same_program(self) -> bool:
    """The decoding step's memory equal to the byte and its program identical (or not compared)."""
    return not self.memory_drift and (self.program is None or self.program.identical)

  def memory_verdict(self) -> str:
    if not self.memory:
      return 'not compared (a side gives no lower_decode_step)'
    if not self.memory['linen'] and not self.memory['nnx']:
      return 'not measured (the backend has no memory analysis)'
    drift = self.memory_drift
    return 'equal to the byte' if not drift else 'differs (NNX ' + ', '.join(drift) + ')'

  def program_verdict(self) -> str:
    if self.program is None:
      return self.program_not_compared
    return self.program.summary()

  def per_token_s(self, side: str) -> float | None:
    """Seconds per token after the first: (all `steps` tokens - one token) / (steps - 1)."""
    if self.steps < 2 or side not in self.total_s:
      return None
    return (self.total_s[side] - self.prefill_s[side]) / (self.steps - 1)

  def verdict(self) -> str:
    if not self.diffs:
      return f'bit-identical ({self.steps} tokens after a {self.prompt_len}-token prompt: tokens, logits, cache)'
    return f'DIFFERS from decode step {self.first_differing_step} ({len(self.diffs)} leaves)'


@dataclasses.dataclass
class CompareResult:
  steps: int
  init_side: str | None  # None: resumed from a checkpoint, which neither side initialised
  linen: SideRun
  nnx: SideRun
  first_divergent_step: int | None  # the first step whose train metrics differ in a bit
  state_diffs: list[str]
  # Per step run, the train metrics (loss and any other) that differ: bitwise.compare_trees lines.
  metric_diffs: list[list[str]] = dataclasses.field(default_factory=list)
  # The run's model and train configs (the reference decoder's: `param_count()`,
  # `batch_size`, `seq_len`), when a client sets them; None for a pair.
  model_cfg: Any = None
  train_cfg: Any = None
  # Why memory and program may differ by design (a client's layout that stores a state differently).
  layout_difference: str | None = None
  seed: int = 0
  mesh_shape: dict[str, int] | None = None  # None: one device, no mesh
  process_count: int = 1
  first_step: int = 0  # > 0: resumed from a checkpoint of step first_step - 1
  final_state_sha256: str | None = None  # of the Linen side's final state (--state-digest)
  declared_program_difference: Any = None  # a pair's program KnownDifference (parity.pairs.adapter)
  # The localizer's finding at the first divergent step: {step, path, layer, pass, max_ulp}.
  first_divergent_module: dict[str, Any] | None = None
  localizer: list[str] | None = None  # its report lines (None: not run)
  num_devices: int = 1
  device_kind: str = ''
  platform: str = ''
  flops: Any = None  # analytic FLOPs per step (`total`, `weights`, `attention`, `summary()`), when a client sets them
  program_diff: programs.ProgramDiff | None = None
  # With a declared program difference: the diff with its modules' operations
  # left out, which must be identical (None: not declared, or nothing differs).
  program_diff_outside: programs.ProgramDiff | None = None
  # Elements of the state's `params/` leaves (a pair's count; the decoder's comes from its config).
  parameters: int | None = None
  memory_compared: bool = True  # False: the run left memory out (a pair without the 'memory' part)
  # The lowered train steps, {'linen': text, 'nnx': text} (not in the JSON).
  program_texts: dict[str, str] | None = dataclasses.field(default=None, repr=False)
  decode: DecodeRun | None = None  # `parity compare --decode N`
  # State only NNX keeps (StockNnx `nnx_only`): NNX's memory with exactly its bytes taken off,
  # what the memory verdict compares, and the accounting line.
  nnx_only_memory: dict[str, Any] | None = None
  nnx_only_accounting: str | None = None
  # Parameters the run's train steps leave bit for bit as they started, on both sides: the numbers
  # compared prove nothing about what computes them (the battery's train part names them too).
  unchanged_params: list[str] = dataclasses.field(default_factory=list)

  def not_proven_line(self) -> str | None:
    """The report's `not proven by values` note, or None where every parameter moved."""
    if not self.unchanged_params:
      return None
    shown = ', '.join(self.unchanged_params[:20]) + (
        f', ... and {len(self.unchanged_params) - 20} more' if len(self.unchanged_params) > 20 else '')
    return (f'Not proven by values: {len(self.unchanged_params)} parameter(s) that the'
            f' {self.steps - self.first_step} train step(s) leave bit for bit as they started, on both sides'
            ' (their gradients zero on every step, or the optimizer leaves them): a bug in what computes'
            f' them, or in what they feed, changes no number compared here ({shown})')

  @property
  def bitwise_equal(self) -> bool:
    return (self.first_divergent_step is None and not self.state_diffs
            and (self.decode is None or not self.decode.diffs))

  @property
  def programs_identical(self) -> bool | None:
    return None if self.program_diff is None else self.program_diff.identical

  @property
  def expected_difference(self) -> str | None:
    """Why memory and program may differ by design (the sides store a state differently),
    or a pair's declared program difference when the program stays within its bound."""
    declared = self.declared_program_difference
    if declared is not None:
      d, outside = self.program_diff, self.program_diff_outside
      if d is not None and not d.identical and 'program' in declared.passes and declared.admits_program(d, outside):
        return (f'declared: {", ".join(declared.paths)}: {declared.reason}'
                f' ({d.changed_lines} of at most {declared.max_changed_lines} canonical lines,'
                f' identical outside those modules)')
      return None
    return self.layout_difference

  @property
  def memory_drift(self) -> list[str]:
    """Each memory-analysis field that differs, with both values (empty: equal to the byte;
    state only NNX keeps accounted)."""
    return memory_drift(self.linen.memory, self._nnx_memory_compared)

  @property
  def memory_verdict(self) -> str:
    if not self.memory_compared:
      return 'not compared'
    if not self.linen.memory and not self.nnx.memory:
      return 'not measured (the backend has no memory analysis)'
    drift = self.memory_drift
    if not drift:
      return 'equal to the byte' + ('' if self.nnx_only_accounting is None else f' ({self.nnx_only_accounting})')
    accounted = '' if self.nnx_only_accounting is None else f'; {self.nnx_only_accounting}'
    declared = self.declared_program_difference
    if declared_memory_admits(declared, self.linen.memory, self._nnx_memory_compared, self._platform):
      bound = declared.temp_bytes(self._platform)
      return (f'differs within the declared bound (NNX ' + ', '.join(drift)
              + f'; at most {bound:,} B of temporaries{accounted})')
    return 'differs (NNX ' + ', '.join(drift) + accounted + ')'

  @property
  def _platform(self) -> str:
    """Where the steps ran and their memory was measured, as a memory bound is read: the platform
    (a result made without one: the first device's), with the mesh's axes where on a mesh
    ('cpu@data=2,tensor=2': parity.pairs.adapter.placement)."""
    return adapter.placement(self.platform or jax.devices()[0].platform, self.mesh_shape)

  @property
  def _nnx_memory_compared(self) -> dict[str, Any]:
    """NNX's memory analysis as compared: state only NNX keeps taken off."""
    return self.nnx_only_memory or self.nnx.memory

  @property
  def program_verdict(self) -> str:
    d = self.program_diff
    if d is None:
      return 'not compared'
    if d.identical:
      return 'identical' + (f' except: {", ".join(d.allowed)}' if d.allowed else '')
    declared, outside = self.declared_program_difference, self.program_diff_outside
    if declared is not None and declared.admits_program(d, outside):
      return (f'differs as declared ({d.changed_lines} of at most {declared.max_changed_lines} canonical'
              f' lines; identical outside {", ".join(declared.paths)})')
    if outside is not None and not outside.identical:
      return (f'differs ({d.changed_lines} canonical lines; {outside.changed_lines} outside the'
              f' declared modules {", ".join(declared.paths)})')
    if declared is not None and d.changed_lines > declared.max_changed_lines:
      return (f'differs ({d.changed_lines} canonical lines, over the declared bound of'
              f' {declared.max_changed_lines})')
    return f'differs ({d.changed_lines} canonical lines)'

  @property
  def same_program(self) -> bool:
    """Memory equal to the byte and programs identical beyond the allowlist, or different by design.

    By design: a declared program difference (within its bound of canonical
    lines, the program identical outside its modules; memory equal to the
    byte, or within the declared memory bound, as the battery's memory part
    asserts); or a layout move, where the
    programs differ but the arguments and outputs (the state) take the same
    bytes and only temporaries may differ (`LAYOUT_MOVE_MEMORY`).
    """
    if self.decode is not None and not self.decode.same_program:
      return False
    if self.expected_difference is None:
      memory = not self.memory_drift or declared_memory_admits(
          self.declared_program_difference, self.linen.memory, self._nnx_memory_compared, self._platform)
      return memory and (self.program_diff is None or self.program_diff.identical)
    if self.declared_program_difference is not None:
      return not self.memory_drift or declared_memory_admits(
          self.declared_program_difference, self.linen.memory, self._nnx_memory_compared, self._platform)
    return not memory_drift(self.linen.memory, self.nnx.memory, exclude=LAYOUT_MOVE_MEMORY)

  @property
  def tokens_per_step(self) -> int | None:
    if self.train_cfg is None:
      return None
    return self.train_cfg.batch_size * self.train_cfg.seq_len

  @property
  def param_count(self) -> int | None:
    return self.parameters if self.model_cfg is None else self.model_cfg.param_count()

  def side(self, name: str) -> SideRun:
    return {'linen': self.linen, 'nnx': self.nnx}[name]

  def tokens_per_s(self, name: str) -> float | None:
    """Tokens per second per device (every position of the batch, padding included)."""
    avg = self.side(name).avg_step_s
    if not avg or self.tokens_per_step is None:
      return None
    return self.tokens_per_step / avg / self.num_devices

  def tflops_per_s(self, name: str) -> float | None:
    """Analytic model TFLOP/s per device (`flops`, set by a client)."""
    avg = self.side(name).avg_step_s
    if not avg or self.flops is None:
      return None
    return self.flops.total / avg / self.num_devices / 1e12

  def verdict(self) -> str:
    if self.bitwise_equal:
      ran = self.steps - self.first_step
      decoded = '' if self.decode is None else f'; decoding: {self.decode.steps} tokens, their logits and cache'
      return f'bit-identical ({ran} steps: train metrics, final parameters and optimizer state{decoded})'
    if self.first_divergent_step is None and not self.state_diffs and self.decode is not None:
      return f'DIVERGED in decoding: {self.decode.verdict()}'
    if self.first_divergent_step is not None:
      i = self.first_divergent_step - self.first_step
      differing = self.metric_diffs[i] if 0 <= i < len(self.metric_diffs) else []
      names = [line.split(':', 1)[0] for line in differing]
      return f'DIVERGED at step {self.first_divergent_step}' + (
          f' ({", ".join(names)})' if names and names != ['loss'] else '')
    return f'DIVERGED: train metrics equal but {len(self.state_diffs)} final state leaves differ'

  def to_json(self) -> dict[str, Any]:
    def side_json(name: str) -> dict[str, Any]:
      run = self.side(name)
      out = dataclasses.asdict(run)
      out.update(
          avg_step_s=run.avg_step_s,
          median_step_s=run.median_step_s,
          tokens_per_s=self.tokens_per_s(name),
          tflops_per_s=self.tflops_per_s(name),
          checkpoint_total_s=sum(run.checkpoint_s),
      )
      return out

    return {
        'bitwise_equal': self.bitwise_equal,
        'first_divergent_step': self.first_divergent_step,
        'first_divergent_module': self.first_divergent_module,
        'localizer': self.localizer,
        'programs_identical': self.programs_identical,
        'verdict': self.verdict(),
        'memory_verdict': self.memory_verdict,
        'program_verdict': self.program_verdict,
        'same_program': self.same_program,
        'expected_difference': self.expected_difference,
        'steps': self.steps,
        'seed': self.seed,
        'init_side': self.init_side,
        'state_diffs': self.state_diffs,
        'metric_diffs': self.metric_diffs,
        'model_config': None if self.model_cfg is None else dataclasses.asdict(self.model_cfg),
        'train_config': None if self.train_cfg is None else dataclasses.asdict(self.train_cfg),
        'param_count': self.param_count,
        'tokens_per_step': self.tokens_per_step,
        'mesh': self.mesh_shape,
        'process_count': self.process_count,
        'first_step': self.first_step,
        'final_state_sha256': self.final_state_sha256,
        'unchanged_params': self.unchanged_params,
        'num_devices': self.num_devices,
        'device_kind': self.device_kind,
        'platform': self.platform,
        'flops_per_step': None if self.flops is None else {
            'total': self.flops.total,
            'weights': self.flops.weights,
            'attention': self.flops.attention,
        },
        'program_diff': None if self.program_diff is None else self.program_diff.to_json(),
        'program_diff_outside_declared': (
            None if self.program_diff_outside is None else self.program_diff_outside.to_json()),
        'linen': side_json('linen'),
        'nnx': side_json('nnx'),
        'decode': None if self.decode is None else {
            **dataclasses.asdict(self.decode),
            'per_token_s': {name: self.decode.per_token_s(name) for name in SIDES},
            'bitwise_equal': not self.decode.diffs,
            'same_program': self.decode.same_program,
        },
    }


def loss_hex(x: Any) -> str:
  return float(np.asarray(x, np.float32)).hex()


# ---------------------------------------------------------------------------
# Compilation
# ---------------------------------------------------------------------------


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


MEMORY_FIELDS = ('argument_bytes', 'output_bytes', 'temp_bytes', 'alias_bytes', 'peak_bytes')
# What a layout move (the layers stacked on another axis) may change: the
# transposes' temporaries. The state the step reads and writes is the same bytes.
LAYOUT_MOVE_MEMORY = ('temp_bytes', 'peak_bytes')


def temporaries_moved(linen: Mapping[str, Any], nnx: Mapping[str, Any]) -> int:
  """The larger of the two steps' differences in temporaries and in peak, in bytes: what a
  declared memory bound is measured against."""
  return max(abs(nnx[f] - linen[f]) for f in LAYOUT_MOVE_MEMORY)


def declared_memory_admits(declared: Any, linen: dict[str, Any], nnx: dict[str, Any],
                           platform: str | None = None) -> bool:
  """A pair's declared memory difference (parity.pairs.adapter.KnownDifference with 'memory') holds
  on `platform` (default: the first device's): arguments, outputs and aliased bytes equal to the
  byte, temporaries and the peak within its `max_temp_bytes` there each."""
  bound = None if declared is None else declared.temp_bytes(platform or jax.devices()[0].platform)
  if bound is None:
    return False
  if memory_drift(linen, nnx, exclude=LAYOUT_MOVE_MEMORY):
    return False
  return all(
      linen.get(f) is not None and nnx.get(f) is not None
      and abs(nnx[f] - linen[f]) <= bound
      for f in LAYOUT_MOVE_MEMORY
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


def memory_drift(linen: dict[str, Any], nnx: dict[str, Any], exclude: tuple[str, ...] = ()) -> list[str]:
  """Each memory-analysis field that differs, as NNX minus Linen (empty: equal to the byte)."""
  out = []
  for field in MEMORY_FIELDS:
    if field in exclude:
      continue
    a, b = linen.get(field), nnx.get(field)
    if a != b:
      out.append(f'{field} {b - a:+,} B' if a is not None and b is not None else f'{field} n/a')
  return out


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


# ---------------------------------------------------------------------------
# Checkpoint saves
# ---------------------------------------------------------------------------

# `(side, step, state)`: saves `state` of `side` as `step` and returns once it
# is committed. The runner times the call.
CheckpointFn = Callable[[Any, int, Any], None]


class OrbaxSaver:
  """Saves each side's state with `parity.store.checkpoints` (Orbax, OCDBT) under `directory/<side>`.

  The save is asynchronous in Orbax; this waits until it is committed, so
  the whole save is timed and no write runs behind the next timed step.
  `blocking_s` keeps, per save, the part a training loop would block on.
  """

  def __init__(self, directory: str, dropout_base: Any):
    from parity.store import checkpoints

    self._checkpoints = checkpoints
    self._directory = directory
    self._dropout_base = dropout_base
    self._managers: dict[str, Any] = {}
    self.blocking_s: dict[str, list[float]] = {name: [] for name in SIDES}

  def __call__(self, side: Any, step: int, state: Any) -> None:
    manager = self._managers.get(side.name)
    if manager is None:
      manager = self._checkpoints.open_manager(os.path.join(self._directory, side.name))
      self._managers[side.name] = manager
    start = time.perf_counter()
    self._checkpoints.save(manager, step, side, state, self._dropout_base)
    self.blocking_s[side.name].append(time.perf_counter() - start)
    manager.wait_until_finished()

  def close(self) -> None:
    for manager in self._managers.values():
      manager.wait_until_finished()
      manager.close()


@contextlib.contextmanager
def _default_saver(directory: str | None, dropout_base: Any) -> Iterator[OrbaxSaver]:
  if directory is not None:
    saver = OrbaxSaver(directory, dropout_base)
    try:
      yield saver
    finally:
      saver.close()
    return
  with tempfile.TemporaryDirectory(prefix='parity-checkpoints-') as tmp:
    saver = OrbaxSaver(tmp, dropout_base)
    try:
      yield saver
    finally:
      saver.close()


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def compare_sides(
    sides: tuple[Any, Any],
    batch: Callable[[int], Any],
    steps: int,
    seed: int = 0,
    init_side: str = 'linen',
    on_step: Callable[[int, SideRun, SideRun], None] | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    checkpoint_every: int = 0,
    checkpoint_fn: CheckpointFn | None = None,
    checkpoint_dir: str | None = None,
    program_diff: bool = True,
    on_phase: Callable[[str], None] | None = None,
    state_digest: bool = False,
    resume_from: tuple[str, int] | None = None,
    declared_program_difference: Any = None,
    localize_divergence: bool = True,
    compare_memory: bool = True,
    decode_steps: int = 0,
    decode_prompt: Any = None,
    decode_temperature: float = 0.0,
) -> CompareResult:
  """Trains any two sides (parity.pairs.adapter.Side) `steps` steps from one state; see the module doc.

  `batch(step)` is the host batch of a train step (numpy arrays).
  `on_step(step, linen_run, nnx_run)` is called once both sides' losses of
  `step` are on the host, before any checkpoint save of that step. With
  `checkpoint_every=N`, both states are saved after steps N-1, 2N-1, ...:
  through `checkpoint_fn` when given, else with Orbax (parity.store.checkpoints)
  under `checkpoint_dir` or a temporary directory. `on_phase` hears what
  the runner is doing before each slow phase (initialising, compiling).
  `resume_from=(directory, step)`: both sides restore the one checkpoint
  saved there as `step` (by either side, by any process count) with its
  dropout key, and train steps `step + 1` to `steps - 1`.
  `declared_program_difference`: a program `KnownDifference` the verdict
  accepts within its bound. When the losses diverge, the localizer runs the
  first divergent step again from the Linen state it started from (carried
  to NNX), and the result names the first divergent module
  (`localize_divergence=False`: not; it keeps one more state alive).
  `compare_memory=False` leaves XLA's memory analysis out of the result and its verdict.
  `decode_steps=N`: after training, both sides decode N tokens after `decode_prompt` (their
  `decode`), timed and compared bit for bit (`DecodeRun`).
  """
  if init_side not in SIDES:
    raise ValueError(f"init_side must be 'linen' or 'nnx', got {init_side!r}")
  if checkpoint_every < 0:
    raise ValueError(f'checkpoint_every must be >= 0, got {checkpoint_every}')
  say = on_phase or (lambda _: None)
  sides = dict(zip(SIDES, sides))
  first_step = 0
  if resume_from is not None:
    from parity.store import checkpoints

    directory, saved_step = resume_from
    say(f'restoring step {saved_step} from {directory} into both sides')
    manager = checkpoints.open_manager(directory, create=False, read_only=True)
    states = {}
    for name in SIDES:
      states[name], dropout_base = checkpoints.restore(manager, saved_step, sides[name])
    manager.close()
    first_step = saved_step + 1
    if first_step >= steps:
      raise ValueError(f'resuming after step {saved_step} leaves nothing to train in {steps} steps')
  else:
    say(f'initialising ({init_side}) and carrying the state to the other side')
    other = 'nnx' if init_side == 'linen' else 'linen'
    states = {init_side: sides[init_side].init(seed)}
    states[other] = sides[other].from_checkpoint(sides[init_side].to_checkpoint(states[init_side]))
    dropout_base = rng.base_key(seed)
    if mesh is not None:  # one array over the whole mesh (every process holds the same key)
      dropout_base = distributed.replicated(dropout_base, mesh)
  runs = {name: SideRun() for name in SIDES}
  # Each parameter's bits where training starts (a digest per leaf: the start state may be donated).
  started = _param_digests(sides['linen'].to_checkpoint(states['linen']))

  first_batch = sides['linen'].place_batch(batch(0))
  compiled = {}
  for name in SIDES:
    say(f'compiling the {name} train step')
    compiled[name] = compile_step(
        sides[name], states[name], first_batch, dropout_base, compare_program=program_diff
    )
    runs[name].lower_s = compiled[name].lower_s
    runs[name].compile_s = compiled[name].compile_s
    # The metrics' structure is the compiled step's: checked once, not in the timed loop.
    adapter.checked_metrics('parity compare', sides[name], 'train_step',
                            compiled[name].executable.out_info[1], need_loss=True)
  device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
  for name in SIDES:
    if compare_memory:
      runs[name].memory = compiled[name].memory(device)
    runs[name].xla_flops = compiled[name].cost_flops()
  nnx_only_memory = nnx_only_line = None
  account = getattr(sides['nnx'], 'nnx_only_accounting', None)
  if compare_memory and account is not None and account()['paths'] and runs['nnx'].memory:
    nnx_only_memory, (nnx_only_line,) = without_nnx_only(
        account(), runs['linen'].memory, runs['nnx'].memory, compiled['linen'], compiled['nnx'], device)
  diff = program_diff_of(compiled['linen'], compiled['nnx']) if program_diff else None
  outside = None
  if diff is not None and not diff.identical and declared_program_difference is not None:
    outside = program_diff_of(compiled['linen'], compiled['nnx'], tuple(declared_program_difference.paths))

  divergence: dict[str, Any] = {}
  with contextlib.ExitStack() as stack:
    if checkpoint_every and checkpoint_fn is None:
      checkpoint_fn = stack.enter_context(_default_saver(checkpoint_dir, dropout_base))
    metric_diffs: list[list[str]] = []
    first_divergent = _train(
        batch, steps, sides, states, compiled, dropout_base, runs,
        on_step, checkpoint_every, checkpoint_fn, first_step,
        divergence if localize_divergence else None, metric_diffs,
    )

  texts = {name: compiled[name].compared_text for name in SIDES}
  localized = _localize(sides, divergence, dropout_base, say, texts) if divergence else None
  decoded = None
  if decode_steps:
    say(f'decoding {decode_steps} tokens on both sides')
    decoded = decode_sides(sides, states, sides['linen'].place_batch({'prompt': decode_prompt})['prompt'],
                           decode_steps, jax.random.fold_in(dropout_base, 1), decode_temperature)
  finals = [sides[name].to_checkpoint(states[name]) for name in SIDES]
  if jax.process_count() > 1 or state_digest:  # each process holds only its shards
    finals = [distributed.host_arrays(f) for f in finals]
  diffs = bitwise.compare_trees(*finals, labels=('Linen', 'NNX'))
  ended = [_param_digests(f) for f in finals]
  unchanged = sorted(p for p, d in started.items() if ended[0].get(p) == d and ended[1].get(p) == d)
  return CompareResult(
      steps=steps,
      init_side=None if resume_from is not None else init_side,
      linen=runs['linen'],
      nnx=runs['nnx'],
      first_divergent_step=first_divergent,
      state_diffs=[str(d) for d in diffs],
      metric_diffs=metric_diffs,
      seed=seed,
      mesh_shape=None if mesh is None else dict(mesh.shape),
      process_count=jax.process_count(),
      first_step=first_step,
      final_state_sha256=bitwise.digest(finals[0]) if state_digest else None,
      num_devices=1 if mesh is None else int(mesh.devices.size),
      device_kind=device.device_kind,
      platform=device.platform,
      declared_program_difference=declared_program_difference,
      first_divergent_module=None if localized is None else localized[0],
      localizer=None if localized is None else localized[1],
      program_diff=diff,
      program_diff_outside=outside,
      parameters=_parameters(finals[0]),
      memory_compared=compare_memory,
      program_texts={name: compiled[name].text for name in SIDES},
      decode=decoded,
      nnx_only_memory=nnx_only_memory,
      nnx_only_accounting=nnx_only_line,
      unchanged_params=unchanged,
  )


def _param_digests(flat: Mapping[str, Any]) -> dict[str, str]:
  """Each parameter's (`params/...`) bit digest, one leaf on the host at a time."""
  return {p: bitwise.digest(distributed.host_arrays({p: x})) for p, x in flat.items() if p.startswith('params/')}


def decode_sides(sides, states, prompt, steps: int, key, temperature: float) -> DecodeRun:
  """Both sides decode `steps` tokens after `prompt` from their states: compiled first (a
  decode of 1 token and of `steps`, untimed), then timed interleaved, each call synchronised
  on its tokens; tokens, logits and the final cache compared bit for bit."""
  run = DecodeRun(steps=steps, prompt_len=int(np.shape(prompt)[1]), temperature=temperature)
  decode = {name: functools.partial(sides[name].decode, states[name], prompt, key=key, temperature=temperature)
            for name in SIDES}
  outs = {}
  for name in SIDES:  # compiles (one token, then all)
    jax.block_until_ready(decode[name](1)['tokens'])
    outs[name] = jax.device_get(decode[name](steps))
  clock = time.perf_counter
  # Best of 3 per side, the order alternating (each side first, then second). The time per
  # token is derived, (all - one) / (steps - 1): on a small model it is within the noise.
  for order in (SIDES, SIDES[::-1], SIDES):
    for name in order:
      start = clock()
      np.asarray(decode[name](1)['tokens'])
      run.prefill_s[name] = min(run.prefill_s.get(name, float('inf')), clock() - start)
      start = clock()
      np.asarray(decode[name](steps)['tokens'])
      run.total_s[name] = min(run.total_s.get(name, float('inf')), clock() - start)
  flat = {name: {'tokens': outs[name]['tokens'], 'logits': outs[name]['logits'], **outs[name]['cache']}
          for name in SIDES}
  run.diffs = [str(d) for d in bitwise.compare_trees(flat['linen'], flat['nnx'], ('Linen', 'NNX'))]
  for what in ('tokens', 'logits'):
    a, b = np.asarray(flat['linen'][what]), np.asarray(flat['nnx'][what])
    if a.shape == b.shape and a.dtype == b.dtype and a.ndim >= 2:
      for step in range(a.shape[1]):
        if not bitwise.bitwise_equal(a[:, step], b[:, step]):
          first = run.first_differing_step
          run.first_differing_step = step if first is None else min(first, step)
          break
  if run.diffs and run.first_differing_step is None:
    run.first_differing_step = steps - 1  # tokens and logits equal: the final cache differs
  lowered = {}
  if all(callable(getattr(sides[name], 'lower_decode_step', None)) for name in SIDES):
    batch, max_len = int(np.shape(prompt)[0]), run.prompt_len + steps
    lowered = {name: sides[name].lower_decode_step(states[name], batch, max_len) for name in SIDES}
  if lowered and all(lowered[name] is not None for name in SIDES):  # None: that side lowers none
    mesh = sides['linen'].mesh
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    run.memory = {name: memory_of(lowered[name].compile(), device) for name in SIDES}
    # A side whose step orders its arguments by its own paths (the kit's decoders: Linen's
    # module names, NNX's attributes) gives no program to compare position by position.
    if all(getattr(sides[name], 'decode_program_comparable', True) for name in SIDES):
      run.program = programs.diff(*(lowered[name].as_text(debug_info=True) for name in SIDES))
    else:
      run.program_not_compared = ("not compared (the kit's decoders order the step's parameters and cache"
                                  ' by each side\'s own paths; its memory is compared)')
  return run


def _parameters(flat: dict[str, Any]) -> int | None:
  """Elements of a state's parameters (checkpoint layout: `params/...`); None if it names none."""
  sizes = [int(np.prod(np.shape(x))) for p, x in flat.items() if p.startswith('params/')]
  return sum(sizes) if sizes else None


def _localize(sides, divergence, dropout_base, say, texts=None) -> tuple[dict | None, list[str]]:
  """The localizer on the first divergent step, both sides from the Linen state before it (on
  the run's mesh, where it has one), with each module whose constraints place its
  intermediates otherwise there (`texts`: the compared programs, with debug locations)."""
  from parity.compare import localize

  step = divergence['step']
  say(f'localizing the divergence at step {step}')
  linen = sides['linen']
  try:
    result = localize.localize_step(
        linen, sides['nnx'], linen.to_checkpoint(divergence['state']),
        linen.place_batch(divergence['batch']), rng.step_key(dropout_base, step, 0),
    )
  except Exception as e:  # the verdict stands without it
    return None, [f'localizer failed: {type(e).__name__}: {e}']
  lines = result.lines()
  mesh = getattr(linen, 'mesh', None)
  if mesh is not None:
    lines += placement.mesh_lines(mesh, result.first(step) is None, texts)
  return result.first(step), lines


def _host_value(x: jax.Array) -> np.ndarray:
  """A replicated value on the host (in a multi-process run, this process's copy)."""
  if not x.is_fully_addressable:
    if not x.sharding.is_fully_replicated:
      # One process holds only its shards: comparing them would compare part of the value.
      raise ValueError(
          f'a train metric ({x.dtype}{list(x.shape)}) is split across processes ({x.sharding}):'
          ' return metrics replicated (e.g. reduce them in the step) to compare them'
      )
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


def _train(
    batch, steps, sides, states, compiled, dropout_base, runs,
    on_step, checkpoint_every, checkpoint_fn, first_step=0, divergence=None, metric_diffs=None,
) -> int | None:
  """The timed loop; fills `runs`, `states` and `metric_diffs` (per step, the train
  metrics that differ), returns the first divergent step."""
  metric_diffs = [] if metric_diffs is None else metric_diffs
  clock = time.perf_counter
  origin = clock()
  first_divergent = None
  for step in range(first_step, steps):
    host_batch = batch(step)
    before = dict(states)
    # Batches are placed (and ready) before the clock starts for either side.
    batches = {
        name: jax.block_until_ready(
            jax.device_put(sides[name].place_batch(host_batch), compiled[name].batch_sharding)
        )
        for name in SIDES
    }
    step_metrics = {}
    order = SIDES if step % 2 == 0 else SIDES[::-1]
    for name in order:
      start = clock()
      states[name], metrics = compiled[name].executable(states[name], batches[name], dropout_base)
      loss = _host_value(metrics['loss'])  # the host synchronisation that ends the step
      end = clock()
      run = runs[name]
      run.step_times.append(end - start)
      run.step_spans.append((start - origin, end - origin))
      run.losses.append(float(loss))
      run.loss_hex.append(loss_hex(loss))
      step_metrics[name] = jax.tree.map(_host_value, dict(metrics))
    # Every metric the steps return, bit for bit (the loss, and e.g. the decoder's z-loss and token count).
    metric_diffs.append([str(d) for d in bitwise.compare_trees(step_metrics['linen'], step_metrics['nnx'], ('Linen', 'NNX'))])
    if first_divergent is None and metric_diffs[-1]:
      first_divergent = step
      if divergence is not None:  # the state the divergent step started from, for the localizer
        divergence.update(step=step, state=before['linen'], batch=host_batch)
    if on_step is not None:
      on_step(step, runs['linen'], runs['nnx'])
    if checkpoint_every and (step + 1) % checkpoint_every == 0:
      saves = (step + 1) // checkpoint_every - 1
      # Alternating too: the first save pays Orbax's set-up, whichever side makes it.
      for name in SIDES if saves % 2 == 0 else SIDES[::-1]:
        start = clock()
        checkpoint_fn(sides[name], step, states[name])
        end = clock()
        runs[name].checkpoint_steps.append(step)
        runs[name].checkpoint_s.append(end - start)
        runs[name].checkpoint_spans.append((start - origin, end - origin))
  return first_divergent
