"""What a side-by-side run found: each side's steps and times, the verdicts on numbers, memory and
program (`CompareResult`), and the memory rules they apply (equal to the byte, a layout move, a
declared bound). Made by the runner (parity/run/runner.py), read by the report."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

from parity.compare import programs
from parity.pairs import adapter

SIDES = ('linen', 'nnx')
# What a pair's `facts()` may tell the report (parity.pairs.adapter.Pair.facts): a title
# (preset, scenario) and the fields of CompareResult that a client sets.
REPORT_FACTS = ('title', 'model_cfg', 'train_cfg', 'flops', 'layout_difference')


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
  title: tuple[str, str] | None = None  # what the report names the run by: (preset, scenario)
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
      return ('differs within the declared bound (NNX ' + ', '.join(drift)
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
