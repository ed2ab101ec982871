"""The `parity compare` report: a side-by-side table, a per-step table, files.

The summary table is the one training logs commonly print for two runs
(Parameters, Final loss, TFLOP/s, Tok/s, Avg s/step, Memory %, JAX; main vs
branch and the difference), here Linen | NNX | Diff (NNX − Linen) with each
difference marked better or worse, plus what a migration needs on top:
where the losses first diverge, compile and checkpoint times, XLA's memory
analysis, the versions of every library involved, the devices, and whether
the two train-step programs are the same. The per-step table shows each
step's losses, whether their bits are equal, and each side's step time.

`Report` renders both tables as text (the terminal) and Markdown (a pull
request comment), writes everything as JSON, and plots the loss curves.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import platform
import sys
from typing import Any, Callable, TextIO

import numpy as np

from parity.compare import programs
from parity.env import xla_env
from parity.run.runner import CompareResult, SideRun

PACKAGES = (('JAX', 'jax'), ('jaxlib', 'jaxlib'), ('Flax', 'flax'), ('Optax', 'optax'),
            ('Orbax', 'orbax-checkpoint'))
DIFF_HEADER = 'Diff (NNX − Linen)'
LOWER_IS_BETTER, HIGHER_IS_BETTER = -1, 1


def environment() -> dict[str, str]:
  """Versions of Python and of every library the two sides run on."""
  env = {'Python': platform.python_version()}
  for label, dist in PACKAGES:
    try:
      env[label] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      env[label] = 'not installed'
  return env


# ---------------------------------------------------------------------------
# Number formatting
# ---------------------------------------------------------------------------


def _count(n: int) -> str:
  """1104218112 -> '1,104,218,112 (1.104 billion)', as the seed says it."""
  for scale, word in ((1e9, 'billion'), (1e6, 'million'), (1e3, 'thousand')):
    if n >= scale:
      return f'{n:,} ({n / scale:.3f} {word})'
  return f'{n:,}'


def _num(x: float | None, digits: int = 4) -> str:
  if x is None:
    return 'n/a'
  if x == 0:
    return '0'
  if abs(x) >= 1e5 or abs(x) < 1e-3:
    return f'{x:.{digits - 1}e}'
  return f'{x:.{max(digits - 1 - int(math.floor(math.log10(abs(x)))), 0)}f}'


def _bytes(n: int | None) -> str:
  if n is None:
    return 'n/a'
  for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
    if n >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{n} B'


def _diff(a: float | None, b: float | None, better: int | None, fmt: Callable = _num) -> str:
  """'b − a' with its relative size and, when they differ, better or worse (`better=None`:
  neither, for a value whose difference is a divergence, not an improvement)."""
  if a is None or b is None:
    return '—'
  d = b - a
  if d == 0:
    return '0'
  rel = f' ({100 * d / a:+.1f}%)' if a else ''
  if better is None:
    mark = 'differs'
  else:
    mark = 'better' if d * better > 0 else 'worse'
  sign = '+' if d > 0 else '-'
  return f'{sign}{fmt(abs(d))}{rel} {mark}'


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
  result: CompareResult
  preset: str = ''
  scenario: str = ''
  mesh: str | None = None
  env: dict[str, str] = dataclasses.field(default_factory=environment)
  # What XLA was told (XLA_FLAGS): bits depend on it, so the report says it.
  xla_flags: list[str] = dataclasses.field(default_factory=xla_env.current_flags)

  # -- tables ----------------------------------------------------------------

  def title(self) -> str:
    r = self.result
    mesh = f'mesh {self.mesh}' if self.mesh else 'one device, no mesh'
    what = (f'preset {self.preset or "?"}, scenario {self.scenario or "?"}'
            if self.scenario != '-' else self.preset)  # '-': a declared pair, named in `preset`
    if r.first_step:  # resumed: the steps after the checkpoint's, from its state
      start = (f'steps {r.first_step} to {r.steps - 1} ({r.steps - r.first_step}), resumed from a'
               f' checkpoint of step {r.first_step - 1}')
      return f'Linen vs NNX: {what}, {start}, seed {r.seed}, {mesh}'
    return (
        f'Linen vs NNX: {what}, {r.steps} steps, seed {r.seed}, {mesh}; {r.init_side} initialises'
    )

  def summary_rows(self) -> list[tuple[str, str, str, str]]:
    """(metric, Linen, NNX, diff) rows of the summary table."""
    r = self.result
    lin, nnx = r.linen, r.nnx
    rows: list[tuple[str, str, str, str]] = []
    same = lambda v: (v, v, '—')
    count = r.param_count
    rows.append(('Parameters', *same(_count(count) if count is not None else 'n/a')))
    final = (lin.losses[-1], nnx.losses[-1]) if lin.losses and nnx.losses else (None, None)
    final_diff = (
        '0 (same bits)' if lin.loss_hex[-1:] == nnx.loss_hex[-1:]
        else _diff(final[0], final[1], None, lambda x: f'{x:.3e}')  # a migration's loss is not to improve
    )
    rows.append(('Final loss', _loss(final[0]), _loss(final[1]), final_diff))
    if r.first_divergent_step is None:
      losses = f'bit-identical ({r.steps} steps)'
    else:
      losses = f'first divergent step: {r.first_divergent_step}'
    rows.append(('Train metrics, bit for bit', '', '', losses))
    state = 'bit-identical' if not r.state_diffs else f'{len(r.state_diffs)} leaves differ'
    rows.append(('Final params + optimizer state', '', '', state))
    rows.append((
        'TFLOP/s per device', _num(r.tflops_per_s('linen')), _num(r.tflops_per_s('nnx')),
        _diff(r.tflops_per_s('linen'), r.tflops_per_s('nnx'), HIGHER_IS_BETTER),
    ))
    rows.append((
        'Tokens/s per device', _num(r.tokens_per_s('linen')), _num(r.tokens_per_s('nnx')),
        _diff(r.tokens_per_s('linen'), r.tokens_per_s('nnx'), HIGHER_IS_BETTER),
    ))
    rows.append((
        'Avg s/step', _num(lin.avg_step_s), _num(nnx.avg_step_s),
        _diff(lin.avg_step_s, nnx.avg_step_s, LOWER_IS_BETTER),
    ))
    rows.append((
        'Median s/step', _num(lin.median_step_s), _num(nnx.median_step_s),
        _diff(lin.median_step_s, nnx.median_step_s, LOWER_IS_BETTER),
    ))
    rows.append((
        'Compile s (step 0 apart)', _num(lin.compile_s), _num(nnx.compile_s),
        _diff(lin.compile_s, nnx.compile_s, LOWER_IS_BETTER),
    ))
    if lin.checkpoint_s or nnx.checkpoint_s:
      median = lambda xs: float(np.median(xs)) if xs else None
      saves = len(lin.checkpoint_s)
      rows.append((
          f'Checkpoint s/save (median of {saves})', _num(median(lin.checkpoint_s)),
          _num(median(nnx.checkpoint_s)),
          _diff(median(lin.checkpoint_s), median(nnx.checkpoint_s), LOWER_IS_BETTER),
      ))
    for label, key in (('arguments', 'argument_bytes'), ('outputs', 'output_bytes'),
                       ('temporaries', 'temp_bytes'), ('peak', 'peak_bytes')):
      a, b = lin.memory.get(key), nnx.memory.get(key)
      rows.append((
          f'Memory per device: {label}', _bytes(a), _bytes(b),
          _diff(a, b, LOWER_IS_BETTER, lambda x: _bytes(int(x))),
      ))
    a, b = lin.memory.get('percent'), nnx.memory.get('percent')
    if a is None and b is None:
      rows.append(('Memory %', *same('n/a (device reports no limit)')))
    else:
      rows.append(('Memory %', _num(a), _num(b), _diff(a, b, LOWER_IS_BETTER)))
    if r.decode is not None:
      d = r.decode
      rows.append((f'Decode: prompt and 1 token, s', _num(d.prefill_s.get('linen')), _num(d.prefill_s.get('nnx')),
                   _diff(d.prefill_s.get('linen'), d.prefill_s.get('nnx'), LOWER_IS_BETTER)))
      rows.append((f'Decode: s/token (of {d.steps})', _num(d.per_token_s('linen')), _num(d.per_token_s('nnx')),
                   _diff(d.per_token_s('linen'), d.per_token_s('nnx'), LOWER_IS_BETTER)))
      rows.append(('Decoding, bit for bit', '', '', d.verdict()))
      if d.memory.get('linen') and d.memory.get('nnx'):
        for field, label in (('argument_bytes', 'arguments'), ('temp_bytes', 'temporaries'),
                             ('peak_bytes', 'peak')):
          a, b = d.memory['linen'].get(field), d.memory['nnx'].get(field)
          rows.append((f'Decode-step memory: {label}', _bytes(a), _bytes(b),
                       _diff(a, b, LOWER_IS_BETTER, lambda x: _bytes(int(x)))))
      rows.append(('Memory (decode step)', '', '', d.memory_verdict()))
      rows.append(('Decode-step program', '', '', d.program_verdict()))
    rows.append(('Memory (train step)', '', '', r.memory_verdict))
    rows.append(('Train-step program', '', '', r.program_verdict))
    if r.expected_difference is not None:
      rows.append(('Differs by design', '', '', r.expected_difference))
    for label in ('JAX', 'Flax', 'Optax', 'Orbax'):
      rows.append((label, *same(self.env.get(label, 'n/a'))))
    devices = f'{r.device_kind or r.platform} x {r.num_devices}'
    rows.append(('Devices', *same(devices)))
    return rows

  def step_rows(self) -> list[tuple[str, ...]]:
    """(step, Linen loss, NNX loss, equal bits, Linen s, NNX s) rows."""
    lin, nnx = self.result.linen, self.result.nnx
    saved = set(lin.checkpoint_steps)
    rows = []
    for i in range(len(lin.losses)):
      step = self.result.first_step + i  # a resumed run starts after its checkpoint's step
      diffs = self.result.metric_diffs
      same = not diffs[i] if i < len(diffs) else lin.loss_hex[i] == nnx.loss_hex[i]
      equal = 'yes' if same else 'NO'
      mark = ' (ckpt after)' if step in saved else ''
      rows.append((
          f'{step}{mark}', _loss(lin.losses[i]), _loss(nnx.losses[i]), equal,
          _seconds(lin.step_times[i]), _seconds(nnx.step_times[i]),
      ))
    return rows

  STEP_HEADER = ('step', 'Linen loss', 'NNX loss', 'equal bits', 'Linen s', 'NNX s')
  SUMMARY_HEADER = ('Metric', 'Linen', 'NNX', DIFF_HEADER)

  def notes(self) -> list[str]:
    r = self.result
    notes = [
        f'{DIFF_HEADER}: better/worse as judged for the NNX side (a final loss that differs is'
        ' a divergence, neither).',
        'Equal bits: every metric the train steps return (the loss and any other), bit for bit.',
        'Step time: from dispatch to the host holding that step\'s loss; the two sides\''
        ' steps interleaved (order alternating); compilation timed apart (step 0 only'
        ' executes); avg and median s/step leave step 0 out.',
        'Tokens/s and TFLOP/s per device use the avg step time; '
        + ('tokens are every position of the batch; ' if r.tokens_per_step is not None
           else 'the run counts no tokens (a pair\'s batch is its own); ')
        + ('FLOPs are analytic, as the run counts them (below).' if r.flops is not None
           else 'the run counts no FLOPs (TFLOP/s n/a).'),
        'Memory: XLA memory analysis of each compiled train step (per device); the verdict'
        ' compares arguments, outputs, temporaries, aliased and peak bytes.',
        ('Program: both train steps canonicalised (arguments named by state path) and'
         ' compared; ' + ('allowed: ' + '; '.join(f'{a.name} ({a.reason})' for a in programs.ALLOWED
                                                  if a.name in r.program_diff.allowed)
                          if r.program_diff.allowed else 'nothing allowed'))
        if r.program_diff is not None else 'Program: not compared (the run skipped it).',
        f'XLA flags (both sides): {" ".join(self.xla_flags) or "(none)"}',
    ]
    if r.flops is not None:
      notes.append(r.flops.summary())
    if r.not_proven_line() is not None:
      notes.append(r.not_proven_line())
    if r.decode is not None:
      notes.append(
          'Decode: each side decodes from its trained state, greedy or sampled from one key; best'
          ' of 3 per side, the order alternating, synchronised on the tokens; "prompt and 1 token"'
          ' is a decode of one token, s/token is (all tokens - one token) / (tokens - 1). Its'
          ' memory and program are one decoding step\'s (a token a row on the full cache), compiled'
          ' on its own.')
    if r.linen.checkpoint_s:
      notes.append(
          'Checkpoint: Orbax save of both states (which side first alternating) after the'
          ' step\'s losses reached the host, timed until committed, not part of any step time.'
      )
    return notes

  def program_lines(self) -> list[str]:
    d = self.result.program_diff
    if d is None:
      return []
    lines = [d.summary()]
    outside = self.result.program_diff_outside
    if self.result.declared_program_difference is not None and outside is not None and not outside.identical:
      # Where the programs part outside the declared modules: the difference not declared.
      lines.append(f'  outside the declared modules: {outside.summary(loop_growth=False)}')
      d = outside
    elif self.result.expected_difference is not None and self.result.declared_program_difference is not None:
      lines.append('  all of it inside the declared modules'
                   f' ({", ".join(self.result.declared_program_difference.paths)}): identical outside them')
    if not d.identical and not d.loop_order:
      lines.append(f'  first difference, Linen: {d.first_linen or "(nothing)"}')
      lines.append(f'  first difference, NNX:   {d.first_nnx or "(nothing)"}')
      lines += ['  ' + line for line in d.parting_lines()]
    return lines

  # -- renderings ------------------------------------------------------------

  def text(self) -> str:
    out = [self.title(), '', _text_table(self.SUMMARY_HEADER, self.summary_rows()), '']
    out += [_text_table(self.STEP_HEADER, self.step_rows()), '']
    out += self.program_lines()
    d = self.result.program_diff
    if d is not None and not d.identical and d.diff:
      if self.result.declared_program_difference is not None and self.result.expected_difference is not None:
        out.append(f'  (within the declared difference: {d.changed_lines} changed lines; the diff\'s first'
                   ' lines are in the --json and --markdown outputs)')
      else:
        out += ['', d.diff]
    out += [''] + [f'- {n}' for n in self.notes()]
    out += self.localizer_lines()
    out += ['', f'verdict: {self.result.verdict()}']
    return '\n'.join(out) + '\n'

  def localizer_lines(self) -> list[str]:
    """Where the first divergent step first computes something different (when run)."""
    r = self.result
    if r.localizer is None:
      return []
    out = ['', f'localizer (step {r.first_divergent_step}, both sides from the same state):']
    first = r.first_divergent_module
    if first is not None:
      layer = '' if first['layer'] is None else f', layer {first["layer"]}'
      if first.get('iteration') is not None:
        layer = f', iteration {first["iteration"]} of its loop'
      ulp = ('no ULP distance (dtypes or shapes differ)' if first['max_ulp'] is None
             else f'max {first["max_ulp"]} ULP')
      out.append(f'  first divergent module: {first["path"]}{layer}, {first["pass"]} pass, {ulp}')
    return out + [f'  {line}' for line in r.localizer]

  def markdown(self) -> str:
    out = [f'### {self.title()}', '', _md_table(self.SUMMARY_HEADER, self.summary_rows()), '']
    out += [_md_table(self.STEP_HEADER, self.step_rows()), '']
    d = self.result.program_diff
    if d is not None:
      out.append(d.summary())
      if not d.identical and d.diff:
        out += ['', '<details><summary>program diff (canonical)</summary>', '', '```diff',
                d.diff, '```', '', '</details>']
      out.append('')
    out += [f'- {n}' for n in self.notes()]
    out += ['', f'**Verdict: {self.result.verdict()}**']
    return '\n'.join(out) + '\n'

  def to_json(self) -> dict[str, Any]:
    out = self.result.to_json()
    out.update(
        preset=self.preset,
        scenario=self.scenario,
        mesh_spec=self.mesh,
        environment=self.env,
        xla_flags=self.xla_flags,
        summary=[dict(zip(self.SUMMARY_HEADER, row)) for row in self.summary_rows()],
    )
    return out

  def write_json(self, path: str) -> None:
    with open(path, 'w') as f:
      json.dump(self.to_json(), f, indent=1)
      f.write('\n')

  def write_markdown(self, path: str) -> None:
    with open(path, 'w') as f:
      f.write(self.markdown())

  def plot(self, path: str) -> None:
    """Loss curves, their absolute difference, and step times, in one PNG."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    r = self.result
    steps = r.first_step + np.arange(len(r.linen.losses))
    linen = np.asarray(r.linen.losses, np.float64)
    nnx = np.asarray(r.nnx.losses, np.float64)
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.plot(steps, linen, 'o-', color='tab:blue', label='Linen', linewidth=2.5, markersize=6)
    ax.plot(steps, nnx, 's--', color='tab:orange', label='NNX', linewidth=1.5, markersize=4)
    ax.set_ylabel('loss')
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(f'{self.preset} / {self.scenario}: {r.verdict()}', fontsize=10)

    ax = axes[1]
    diff = np.abs(nnx - linen)
    ax.plot(steps, diff, 'o-', color='tab:red')
    ax.set_ylabel('|NNX − Linen| loss')
    ax.grid(alpha=0.3)
    if not diff.any():
      ax.set_ylim(-0.05, 1)
      ax.text(0.5, 0.5, 'all differences are exactly 0', transform=ax.transAxes,
              ha='center', color='tab:red')

    ax = axes[2]
    for run, name, style in ((r.linen, 'Linen', 'o-'), (r.nnx, 'NNX', 's--')):
      ax.plot(steps, 1e3 * np.asarray(run.step_times), style, label=f'{name} step')
    for i, step in enumerate(r.linen.checkpoint_steps):
      ax.axvline(step + 0.5, color='grey', linestyle=':',
                 label='checkpoint save (timed apart)' if i == 0 else None)
    ax.set_ylabel('step time (ms)')
    ax.set_xlabel('step')
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _loss(x: float | None) -> str:
  return 'n/a' if x is None else f'{x:.9g}'


def _seconds(x: float) -> str:
  return f'{x:.4f}' if x >= 1e-3 else f'{x:.2e}'


def _text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  line = lambda cells: '  '.join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return '\n'.join([line(header), line(['-' * w for w in widths])] + [line(r) for r in rows])


def _md_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  esc = lambda c: str(c).replace('|', '\\|') or ' '
  out = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  out += ['| ' + ' | '.join(esc(c) for c in row) + ' |' for row in rows]
  return '\n'.join(out)


# ---------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------


class Progress:
  """A bar on a terminal, one plain line per step otherwise (CI logs)."""

  def __init__(self, steps: int, stream: TextIO | None = None, width: int = 30):
    self.steps = steps
    self.stream = stream or sys.stderr
    self.width = width
    self.tty = bool(getattr(self.stream, 'isatty', lambda: False)())

  def phase(self, message: str) -> None:
    if self.tty:
      self.stream.write(f'\r\033[K{message} ...')
    else:
      self.stream.write(f'{message} ...\n')
    self.stream.flush()

  def step(self, step: int, linen: SideRun, nnx: SideRun) -> None:
    same = linen.loss_hex[-1] == nnx.loss_hex[-1]
    detail = (
        f'Linen {_seconds(linen.step_times[-1])} s, NNX {_seconds(nnx.step_times[-1])} s,'
        f' losses {"equal" if same else "DIFFER"}'
    )
    done = step + 1
    if self.tty:
      filled = self.width * done // self.steps
      bar = '#' * filled + '.' * (self.width - filled)
      self.stream.write(f'\r\033[K[{bar}] step {done}/{self.steps}: {detail}')
      if done == self.steps:
        self.stream.write('\n')
    else:
      self.stream.write(f'step {step} ({done}/{self.steps}): {detail}\n')
    self.stream.flush()
