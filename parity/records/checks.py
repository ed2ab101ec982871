"""The battery of a recorded pair: each part compares the live side with the record.

Structure, specs, program and memory run the battery's own checks, the record standing for the
deleted side (parity/records/side.py). Init, grads, train, eval, decode and mesh compare the live
side's results (parity/records/results.py) with the record's, entry by entry, naming the first
that differs by its step and leaf. The parts that need the deleted side alive raise
`NotCheckable`, saying why; nothing is passed unchecked.

A record taken in another environment (platform, devices, jax, jaxlib, flax, XLA flags, CPU
features: parity/records/environment.py) is refused before any bit is compared; structure and
specs, which do not depend on it, are compared anywhere."""
from __future__ import annotations

from typing import Any, Sequence

from parity.pairs import adapter
from parity.records import environment
from parity.records import results
from parity.records.side import RecordedSide, is_recorded


class NotCheckable(Exception):
  """A part that cannot be checked against a record (the plugin reports it as skipped, with why)."""


# The parts that need the deleted side alive, and why.
CANNOT = {
    'checkpoints': 'saving on one side and restoring on the other needs both sides alive (the NNX side'
                   ' alone saving and restoring is tests of its own)',
    'resume': 'resuming one side\'s training on the other needs both sides alive',
    'convert': 'converting a checkpoint to the deleted side\'s layout and training there needs that side'
               ' alive (`parity convert` still reads the deleted side\'s checkpoints by their recorded layout)',
    'localize': 'the localizer compares every module\'s values on both sides, of which a record keeps none',
    'substitution': 'a substitution runs the deleted side against a substitute of the live one',
}
SHOWN = 12  # the differing entries a failure lists

CANNOT_LINEN_ALONE = 'the Linen side\'s own save and restore needs that side alive'
# The parts whose results do not depend on the environment's bits.
ANYWHERE = ('structure', 'specs')


def recorded_pair(pair: adapter.Pair) -> bool:
  """Whether `pair`'s Linen side is a record (its sides are made to tell, and kept for the parts).

  Sides that fail to build are no record: the part builds them again and reports the error as
  its own (the shared runs' memory of a failure is not touched here)."""
  from parity.battery.checks.shared import _Runs, _runs

  runs = _runs(pair)
  try:
    sides = _Runs.sides.__wrapped__(runs, None)  # the cached run itself, as `runs.sides()` calls it
  except Exception:  # noqa: BLE001 (reported by the part)
    return False
  return is_recorded(sides[0])


def check(pair: adapter.Pair, part: str, **params: Any) -> list[str]:
  """`part` of the battery of `pair`, whose Linen side is a record; `params` as the plugin's
  (init_side, direction, parity_mesh, decode_placement)."""
  from parity.battery import checks as battery
  from parity.battery.checks.shared import _runs

  runs = _runs(pair)
  record_side = runs.sides()[0]
  record = record_side.record
  direction = params.get('direction')
  if part == 'checkpoints' and direction == 'nnx->nnx':  # the live side alone: its own round trip
    _same_environment(pair, record_side)
    battery.check_checkpoint(pair, direction)
    return [f'checkpoints ({direction}): the NNX side\'s own save and restore, from the recorded start']
  if part in CANNOT:
    why = (CANNOT_LINEN_ALONE if direction == 'linen->linen' else CANNOT[part])
    raise NotCheckable(f'{pair.name}: {part}{f" ({direction})" if direction else ""} is not checked against the'
                       f' record {record.name}: {why}')
  if part not in ANYWHERE:
    _same_environment(pair, record_side)
    _same_runs(pair, record)
  if part not in record.manifest['parts']:
    raise AssertionError(f'{pair.name}: the record {record.name} has no {part} (recorded:'
                         f' {", ".join(record.manifest["parts"])}); take it again with that part')
  if part == 'structure':
    battery.check_structure(pair)
    return []
  if part == 'specs':
    notes = battery.check_specs(pair)
    table = record.table('specs')
    for spec in pair.meshes:  # where each leaf is placed on each mesh, before anything runs
      if f'physical {spec}' in table:
        compare_entries(pair, record.name, f'the state\'s placement on {spec}', table[f'physical {spec}'],
                        results.physical(runs, 'nnx', spec))
        notes.append(f'state placement on {spec}: {len(table[f"physical {spec}"])} leaves as recorded')
    return notes
  if part == 'program':
    try:
      return battery.check_program(pair)
    except AssertionError as e:
      raise AssertionError(f'{e}\n{_live_program_line(runs, record)}') from None
  if part == 'memory':
    return battery.check_memory(pair)
  if part == 'init':
    return _check_init(pair, runs, record)
  qualifier, live = {
      'grads': lambda: ('common start', results.grads(runs, 'nnx')),
      'train': lambda: (f'from={params["init_side"]}', results.train(runs, 'nnx', params['init_side'])),
      'eval': lambda: ('trained', results.evaluation(runs, 'nnx')),
      'decode': lambda: (params['decode_placement'], results.decode(runs, 'nnx', params['decode_placement'])),
      'mesh': lambda: (params['parity_mesh'], results.mesh(runs, 'nnx', params['parity_mesh'])),
  }[part]()
  table = record.table(part)
  if qualifier not in table:
    raise AssertionError(f'{pair.name}: the record {record.name} has no {part} for {qualifier} (recorded:'
                         f' {", ".join(table)}); take it again with the pair as it is declared now')
  compare_entries(pair, record.name, f'{part} ({qualifier})', table[qualifier], live)
  return [f'{part} ({qualifier}): {len(live)} entries bit for bit as recorded in {record.name}']


def _same_environment(pair: adapter.Pair, side: RecordedSide) -> None:
  differs = environment.differences(side.record.manifest['environment'], environment.current())
  if differs:
    raise AssertionError(
        f'{pair.name}: the record {side.record.name} was taken in another environment, so its bits are not'
        ' compared here (the same program may round otherwise):\n  ' + '\n  '.join(differs)
        + '\nRun where it was taken, or take the record again here from the last code that has the Linen'
        ' side (`parity record --pair FILE.py:NAME --side linen DIR` at that commit; docs/after-linen.md)')


def _same_runs(pair: adapter.Pair, record: Any) -> None:
  """The pair asks for the runs the record holds: its seed and steps (a run of other length or
  start would compare nothing that was recorded)."""
  manifest = record.manifest
  asked = [f'{what}={getattr(pair, what)!r} where the record was taken with {manifest[what]!r}'
           for what in ('seed', 'steps') if getattr(pair, what) != manifest[what]]
  if asked:
    raise AssertionError(f'{pair.name}: the pair declares {"; ".join(asked)} ({record.name}): declare it as'
                         ' recorded, or take the record again')


def compare_entries(pair: adapter.Pair, where: str, what: str, recorded: Sequence[tuple[str, str, str]],
                    live: Sequence[tuple[str, str, str]]) -> None:
  """Every entry of `live` as `recorded` keeps it (its type and bits), in the same entries; an
  AssertionError naming the first that differs, then the rest."""
  got = {key: (kind, value) for key, kind, value in live}
  kept = {key for key, _, _ in recorded}
  problems = []
  for key, kind, value in recorded:
    if key not in got:
      problems.append(f'{key}: recorded ({kind} {value}), not in the live run')
    elif (got[key][0], _bits(got[key][1])) != (kind, _bits(value)):
      problems.append(f'{key}: recorded {kind} {value}, live {got[key][0]} {got[key][1]}')
  problems += [f'{key}: in the live run ({kind} {value}), not recorded' for key, kind, value in live if key not in kept]
  if problems:
    raise AssertionError(
        f'{pair.name}: {what} differs from the record {where} in {len(problems)} of {len(recorded)} entries;'
        f' first: {problems[0]}\n  ' + '\n  '.join(problems[1:SHOWN])
        + (f'\n  ... and {len(problems) - SHOWN} more (the record\'s {where}/*.txt tables, one line per entry)'
           if len(problems) > SHOWN else ''))


def _bits(value: str) -> str:
  """What an entry's value is compared by: its bits or digest (a scalar's number after them is for reading)."""
  return value.split(' ', 1)[0]


def _check_init(pair: adapter.Pair, runs: Any, record: Any) -> list[str]:
  """The live side's own init against the deleted side's as recorded, by the init part's rule: a
  leaf random on both sides in distribution, any other bit for bit."""
  from parity.battery.checks import init as init_part

  recorded = record.table('init')['own init']
  live = {key: (kind, value) for key, kind, value in results.init(runs, 'nnx')}
  problems = []
  for key, kind, value in recorded:
    if key not in live:
      problems.append(f'{key}: recorded, not in the live init')
      continue
    live_kind, live_value = live[key]
    a, b = results.parse_stats(value), results.parse_stats(live_value)
    if kind != live_kind:
      problems.append(f'{key}: recorded {kind}, live {live_kind}')
    elif a is None or b is None:
      if _bits(value) != _bits(live_value):
        which = ' and '.join(n for n, s in (('recorded', a), ('live', b)) if s is None)
        problems.append(f'{key}: recorded {value}, live {live_value} (not random in {which}: compared bit for bit)')
    else:
      problem = init_part.distribution_problem(key, a, b)
      if problem:
        problems.append(problem)
  problems += [f'{key}: in the live init, not recorded' for key in live if key not in {k for k, _, _ in recorded}]
  if problems:
    raise AssertionError(
        f'{pair.name}: the NNX side\'s own init differs from the Linen side\'s recorded in {record.name}'
        f' beyond what random initialisers explain ({len(problems)} leaves; recorded vs live):\n  '
        + '\n  '.join(problems[:50]))
  return []


def _live_program_line(runs: Any, record: Any) -> str:
  """Where the live side's canonical program is written, to diff against the record's."""
  import tempfile

  from parity.compare import programs
  from parity.records import files

  step = runs.compiled('nnx')
  path = tempfile.NamedTemporaryFile('w', prefix='parity-live-program-', suffix='.txt', delete=False).name
  with open(path, 'w') as f:
    f.write(programs.canonicalize(step.compared_text, step.argument_names))
  return (f'the whole canonical programs, the recorded and the live one: diff {record.directory / files.CANONICAL}'
          f' {path}')
