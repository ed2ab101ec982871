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
import functools
import os
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from parity.compare import placement, programs
from parity.core import bitwise, rng
from parity.pairs import adapter
from parity.procs import distributed
from parity.run.compiling import compile_step, memory_of, program_diff_of, without_nnx_only
from parity.run.verdicts import REPORT_FACTS, SIDES, CompareResult, DecodeRun, SideRun, loss_hex


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


def compare_pair(pair: adapter.Pair, steps: int | None = None, *, sides: tuple[Any, Any] | None = None,
                 mesh: jax.sharding.Mesh | None = None, seed: int | None = None, program_diff: bool = True,
                 **options) -> CompareResult:
  """A declared pair's sides trained side by side (`compare_sides` over its train batches), as far
  as its parts go: memory, the program and the localizer only where `pair.parts` holds them; its
  declared program difference and its report facts (`Pair.facts`) on the result.

  `sides`: the pair's sides on `mesh`, where the caller made them (`make_pair_sides`); `steps`
  and `seed` default to the pair's.
  """
  from parity.battery.parts import PARTS

  parts = set(PARTS if pair.parts is None else pair.parts)
  if sides is None:
    sides = adapter.make_pair_sides(pair, mesh)
  result = compare_sides(
      sides, lambda step: pair.batch(step, 'train'), pair.steps if steps is None else steps,
      seed=pair.seed if seed is None else seed, mesh=mesh,
      program_diff=program_diff and 'program' in parts,
      declared_program_difference=pair.program_difference(),
      compare_memory='memory' in parts, localize_divergence='localize' in parts, **options,
  )
  facts = dict(pair.facts()) if pair.facts is not None else {}
  unknown = sorted(set(facts) - set(REPORT_FACTS))
  if unknown:
    raise adapter.SideError(f'{pair.name}: facts() gave {", ".join(unknown)}; a pair\'s facts are'
                            f' {", ".join(REPORT_FACTS)} (parity.pairs.adapter.Pair.facts)')
  for name, value in facts.items():
    setattr(result, name, value)
  return result


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
