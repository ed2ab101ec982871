"""`parity.record(pair, out)`: the Linen side's battery results, written as a record.

Run while both sides are alive: each result comes from the battery's shared runs of the pair, as
its parts compute them, and what the NNX side took from the Linen side (its module
correspondences, Linen's dropout draws) is kept for it."""
from __future__ import annotations

import json
import os
import sys
from typing import Callable

import jax

from parity.battery.parts import ONE_DEVICE
from parity.pairs import adapter
from parity.records import environment
from parity.records import files
from parity.records import results
from parity.run import compiling

# The parts that run the side (the others read its shapes, specs and program).
RUNNING = ('init', 'grads', 'train', 'eval', 'checkpoints', 'resume', 'convert', 'mesh', 'localize',
           'substitution', 'decode')

# A record keeps the common start's values (every recorded run begins there); above this it
# refuses, as a record is made to be committed: record a smaller configuration of the model.
MAX_START_BYTES = 64 << 20


def _progress_to_stderr(line: str) -> None:
  print(f'parity record: {line}', file=sys.stderr, flush=True)


def record(pair: adapter.Pair, out: str | os.PathLike, side: str = 'linen', *,
           progress: Callable[[str], None] | None = _progress_to_stderr) -> files.Record:
  """Records `side` of `pair` into the directory `out` (replaced whole once complete) and returns it."""
  from parity.battery.checks import shared
  from parity.battery.checks import specs
  from parity.compare import programs

  if side != 'linen':
    raise ValueError(f"parity record: side {side!r}: a record stands for the deleted side, 'linen'")
  bounds = [d.describe() for d in pair.known_differences if d.value_passes]
  if bounds:
    raise ValueError(
        f'{pair.name}: declares a value bound ({"; ".join(bounds)}): a record keeps digests, which'
        ' tell equal from different, not by how many ULP; record the pair with its substitute sides'
        ' (every value then bit for bit), or keep the Linen side until the bound is gone')
  say = progress or (lambda line: None)
  runs = shared._runs(pair)
  linen, live = runs.sides()
  wanted = set(pair.parts) if pair.parts is not None else None
  # Parts that run nothing (structure, specs, program, memory) are recorded from shapes alone, as
  # `eval_shape` gives them: a preset too large to run is recorded without its start.
  abstract = wanted is not None and not wanted & set(RUNNING)
  start = linen.abstract_checkpoint() if abstract else runs.start('linen')
  size = sum(int(x.size) * x.dtype.itemsize for x in start.values())
  if size > MAX_START_BYTES and not abstract:
    raise ValueError(
        f'{pair.name}: the common start is {size:,} B, over the {MAX_START_BYTES:,} B a record keeps of'
        ' it (every recorded run begins there): record a smaller configuration of the model, as the'
        ' battery runs one')
  recorded: list[str] = []
  writer = files.Writer(out)
  try:
    def part(name):
      take = wanted is None or name in wanted
      if take:
        say(name)
        recorded.append(name)
      return take

    writer.table('structure', {'checkpoint layout': [
        (path, results.digests.kind(x), '-') for path, x in sorted(linen.abstract_checkpoint().items())]})
    say('structure')
    recorded.append('structure')
    layouts = _own_layouts(pair, runs.sides())
    if layouts:
      writer.layouts(layouts)
    if not abstract:
      writer.start(jax.device_get(start))
    writer.table('specs', {'logical': [
        (path, '-', json.dumps(list(spec))) for path, spec in sorted(linen.param_specs().items())],
        **{f'physical {spec}': results.physical(runs, 'linen', spec) for spec in pair.meshes}})
    if part('specs') and not pair.activations_resolved:
      table, = specs.activation_tables(pair, (linen,), [_state(linen, start)], runs.batch(0), runs.dropout_base())
      writer.activations(table)
    if part('init'):
      writer.table('init', {'own init': results.init(runs, 'linen')})
    if part('grads'):
      writer.table('grads', {'common start': results.grads(runs, 'linen')})
    if part('train'):
      writer.table('train', {f'from={init}': results.train(runs, 'linen', init) for init in ('linen', 'nnx')})
    if part('eval'):
      writer.table('eval', {'trained': results.evaluation(runs, 'linen')})
    if pair.decode is not None and part('decode'):
      writer.table('decode', {placement: results.decode(runs, 'linen', placement)
                              for placement in (ONE_DEVICE, *pair.meshes)})
    if pair.meshes and part('mesh'):
      writer.table('mesh', {spec: results.mesh(runs, 'linen', spec) for spec in pair.meshes})
    program = None
    if part('program') | part('memory'):
      step = compiling.compile_step(linen, _state(linen, start), runs.batch(0), runs.dropout_base()) if abstract \
          else runs.compiled('linen')
      writer.program(step.compared_text, programs.canonicalize(step.compared_text, step.argument_names))
      program = {'argument_names': step.argument_names, 'allowed_applied': step.allowed_applied,
                 'memory': step.memory(jax.devices()[0])}
    manifest = {
        'pair': pair.name,
        'side': side,
        'seed': pair.seed,
        'steps': pair.steps,
        'meshes': list(pair.meshes),
        'decode': None if pair.decode is None else {
            'steps': pair.decode.steps, 'temperatures': list(pair.decode.temperatures)},
        'parts': sorted(set(recorded)),
        'abstract': abstract,
        'layouts': sorted(layouts),
        'rules': None if getattr(linen, 'rules', None) is None else [list(r) for r in linen.rules],
        'adopted': live.adopted() if hasattr(live, 'adopted') else None,
        'program': program,
        'environment': environment.current(),
    }
    done = writer.finish(manifest)
  except BaseException:
    writer.abandon()
    raise
  say(f'{pair.name}: {len(done.manifest["parts"])} parts recorded in {out} ({files.size(out):,} B)')
  return done


def _state(side, start):
  """The side's state from the common start, or from its shapes alone (an abstract record)."""
  if all(isinstance(x, jax.ShapeDtypeStruct) for x in start.values()):
    return adapter.abstract_state(side)
  return side.from_checkpoint(start)


def _own_layouts(pair, sides) -> dict:
  """The Linen side's own checkpoint layouts (`parity convert` reads its checkpoints by them once it
  is gone); none for a side whose state layout the converter cannot read (no `template`)."""
  from parity.store.pair_convert import layouts

  try:
    found = layouts.pair_layouts(sides, getattr(pair, 'saves', None))
  except layouts.ConvertError:
    return {}
  return {fmt: layout for fmt, layout in found.items() if layout.role == 'linen'}
