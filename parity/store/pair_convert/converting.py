"""Converting one side's checkpoint into the other's (`convert_checkpoint`), and states in the other's layout."""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Callable, Sequence

from parity.core.errors import TreeMismatchError
import parity.store.pair_convert.atomic as atomic
import parity.store.pair_convert.streaming as streaming
from parity.store.pair_convert.atomic import ConvertError
from parity.store.pair_convert.layouts import OWN_FORMATS, ROLES, SIDE_OF_FORMAT, axis_moves, pair_layouts
from parity.store.pair_convert.reading import _problems, identify, locate
from parity.store.pair_convert.restore import pair_sides, verify_conversion
from parity.store.pair_convert.writing import _plan, _write_checkpoint, nnx_only_values


@dataclasses.dataclass
class ConvertResult:
  """What a conversion did; `differences` is `verify`'s (empty: bit for bit, or not verified)."""

  dst: str
  to: str
  source_format: str
  target_format: str
  step: int | None
  arrays: int
  bytes: int
  seconds: float
  dropped: list[str]  # SRC's state only NNX keeps, which the Linen side has no place for
  initialised: list[str]  # DST's state only NNX keeps, as `create(0)` makes it
  verified: bool | None = None  # None: not verified
  differences: list[str] = dataclasses.field(default_factory=list)
  written: bool = True  # False: verification failed, nothing left at DST


def convert_checkpoint(
    pair: Any, src: str | os.PathLike, dst: str | os.PathLike, to: str, *, step: int | None = None,
    item: str | None = None, target_format: str | None = None, verify: bool = False, mesh: Any = None,
    sides: Sequence[Any] | None = None, overwrite: bool = False,
    progress: Callable[[streaming.Progress], None] | None = None,
) -> ConvertResult:
  """Converts SRC, written by one side's own save code, into DST, which the other side's own restore
  code reads, through the pair's correspondences.

  `to`: 'linen' or 'nnx'. `target_format`: one of that side's FORMATS (default: `linen`, or
  `nnx` for `nnx.state((model, optimizer))`). `step`, `item`: of a CheckpointManager SRC (default: its
  latest step; the item that is one side's state). `verify`: restore both with the sides' own
  restore code and take one train step on each (on `mesh`; None: one device), and leave DST only
  when every leaf is bit for bit. `overwrite`: a non-empty DST is replaced (renamed aside, the
  conversion renamed into its place, then the old one removed; SIGTERM and Ctrl-C wait while the two
  renames run). `progress`: called with a streaming.Progress as arrays and boxes are written.

  All or nothing: the output is written into a temporary directory beside DST and renamed into place
  once complete (and verified). Raises ConvertError or TreeMismatchError on bad input and
  ConvertError when the output cannot be written, with nothing written to DST (should the old DST of
  `overwrite` then fail to go back, the message says where it is); atomic.Interrupted on SIGTERM or
  Ctrl-C (saying whether DST already holds the conversion). A conversion killed outright (SIGKILL)
  leaves its temporary directory, which the next conversion to DST removes (putting an old DST back
  if the kill came between the two renames).
  """
  start = time.perf_counter()
  src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
  if to not in ROLES:
    raise ConvertError(f"--to must be 'linen' or 'nnx', got {to!r}")
  # Default: the layout the target side's own restore code reads (its declared one, else its stock tree).
  target_format = target_format or (f'{to}-own' if to in (getattr(pair, 'saves', None) or {}) else to)
  if SIDE_OF_FORMAT.get(target_format) != to:
    raise ConvertError(f'target format {target_format!r} is not the {to} side\'s; its formats:'
                       f' {[f for f, r in SIDE_OF_FORMAT.items() if r == to]}')
  sides = tuple(sides) if sides is not None else pair_sides(pair, mesh)
  if hasattr(sides[0], 'recorded_layouts'):  # the Linen side a record (parity/records/)
    if to == 'linen' or verify:
      raise ConvertError(
          f'{pair.name}: the Linen side is a record ({sides[0].record.name}): a checkpoint of it is read by its'
          ' recorded layout and converted to NNX; '
          + ('writing one for Linen' if to == 'linen' else '--verify, which restores and trains both sides,')
          + ' needs the Linen side alive')
    if not sides[0].recorded_layouts():
      raise ConvertError(f'{pair.name}: the record {sides[0].record.name} keeps no checkpoint layout of the Linen'
                         ' side (its side had no `template` when recorded): nothing to read a checkpoint by')
  layouts = pair_layouts(sides, getattr(pair, 'saves', None))
  if target_format not in layouts:
    if target_format in OWN_FORMATS:
      raise ConvertError(f'target format {target_format!r}: pair {pair.name!r} declares no saves[{to!r}]'
                         ' (the function building the tree the side\'s own save code writes)')
    target_format = to if target_format == 'linen-unboxed' else target_format  # no boxes: one tree
  atomic.restore_replaced(dst)
  atomic.check_dst(src, dst, overwrite)
  source_item = locate(src, 'SRC', step, item, layouts)
  other = [f for f in layouts if SIDE_OF_FORMAT[f] != to]
  try:
    source, _ = identify(source_item, layouts, pair.name, formats=other)
  except TreeMismatchError:
    same = [f for f in layouts if SIDE_OF_FORMAT[f] == to]
    if any(not _problems(layouts[f], source_item.arrays) for f in same):
      raise ConvertError(f'SRC {source_item.describe()} is already the {to} side\'s checkpoint:'
                         f' nothing to convert (--to {"nnx" if to == "linen" else "linen"} converts it)') from None
    raise
  target = layouts[target_format]
  values = nnx_only_values(sides[1], target) if to == 'nnx' else {}
  # Where a side stores a leaf with its axes moved against the pair's layout (the reference decoder's
  # NNX side stacking layers on axis 0 in 10_scan_axis0), the job transposes it box by box.
  moves = {role: axis_moves(side) for role, side in zip(ROLES, sides) if not hasattr(side, 'recorded_layouts')}
  jobs, dropped = _plan(source, source_item, target, values, moves)
  custom = {'source': src, 'step': source_item.step, 'to': to, 'from_format': source.format,
            'format': target_format, 'pair': pair.name}
  result = ConvertResult(dst, to, source.format, target_format, source_item.step, len(jobs),
                         sum(j.nbytes for j in jobs), 0.0, dropped,
                         [j.target.disk for j in jobs if j.source is None])
  if verify:
    _check_verify_fits(result.bytes, mesh)
  state = streaming.Progress(len(jobs), result.bytes)
  tmp = atomic.make_partial(dst)
  signals = atomic._Signals()
  stage = 'writing the converted arrays'
  try:
    with signals:
      _write_checkpoint(source_item, target, jobs, tmp, dst, custom, state, progress)
      stage = 'syncing the conversion to disk'
      atomic._fsync_tree(tmp)
      if verify:
        stage = 'verifying the conversion'
        written = locate(tmp, 'DST', source_item.step, source_item.item)
        result.differences = verify_conversion(pair, source_item, source, written, target, sides)
        result.verified = not result.differences
        if result.differences:
          shutil.rmtree(tmp, ignore_errors=True)
          result.written = False
          result.seconds = time.perf_counter() - start
          return result
      stage = 'moving the conversion into DST'
      atomic.move_into_place(tmp, dst, signals, overwrite)
  except BaseException as e:
    raised = atomic.cleanup_after(e, signals, tmp, dst, stage)
    if raised is e:
      raise
    raise raised from None
  result.seconds = time.perf_counter() - start
  return result


def _memory_free(mesh: Any) -> tuple[int, str] | None:
  """(bytes the verification's devices have, what they are); None where it cannot be told."""
  import jax

  devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
  if all(d.platform == 'cpu' for d in devices):
    try:
      return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'), 'host memory available'
    except (ValueError, OSError, AttributeError):
      return None
  total = 0
  for device in devices:
    stats = device.memory_stats() or {}
    if 'bytes_limit' not in stats:
      return None
    total += stats['bytes_limit'] - stats.get('bytes_in_use', 0)
  return total, f'free on {len(devices)} {devices[0].platform} device(s)'


def _check_verify_fits(state_bytes: int, mesh: Any) -> None:
  """Refuses `verify` plainly, before anything is written, where the two restored states alone
  (SRC's and DST's, before a train step's temporaries) exceed the devices' memory."""
  free = _memory_free(mesh)
  if free is None or 2 * state_bytes <= free[0]:
    return
  raise ConvertError(
      f'--verify restores both states and trains each one step: at least {2 * state_bytes / 1e9:.2f} GB'
      f' (twice the {state_bytes / 1e9:.2f} GB state), more than the {free[0] / 1e9:.2f} GB {free[1]}.'
      ' Convert without --verify (the conversion streams, box by box), then compare SRC with DST by'
      ' parity diff-checkpoints (streaming too), or verify on a machine where the model fits'
      f' (--mesh spreads it over more devices); {atomic.NOTHING_WRITTEN}')


def _nnx_state(state: Any) -> Any:
  """`nnx.state((model, optimizer))` of a `(model, optimizer)` pair; a State as it is."""
  from flax import nnx

  if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], nnx.Module):
    return nnx.state(state)
  return state


def to_linen_layout(pair: Any, nnx_state: Any, *, boxed: bool = True) -> Any:
  """The NNX side's state (`nnx.state((model, optimizer))`, or the pair itself) as the Linen side's
  TrainState, through the pair's correspondences: what Linen's own restore code reads, so NNX
  training code can save checkpoints a Linen run resumes from. `boxed`: boxes as the Linen side's
  `create` makes them (its restore target), else unboxed."""
  from parity.core import paths
  from parity.core import state as state_lib

  linen, nnx_side = pair_sides(pair, None)
  flat = nnx_side.to_checkpoint(_nnx_state(nnx_state))
  template = getattr(linen, '_boxed_template', linen.template) if boxed else linen.template
  if 'step' in flat:
    flat = {**flat, 'step': state_lib.convert_step(flat['step'], state_lib.LINEN_STEP_DTYPE)}
  return paths.fill('NNX state -> Linen train state', template, flat)


def to_nnx_layout(pair: Any, linen_state: Any, *, pure: bool = False) -> Any:
  """The Linen side's TrainState as the NNX side's `nnx.state((model, optimizer))` (a pure dict with
  `pure`), through the pair's correspondences; state only NNX keeps as `create(0)` makes it. What
  NNX's own restore code reads (or `nnx.update((model, optimizer), state)` takes)."""
  from flax import nnx

  linen, nnx_side = pair_sides(pair, None)
  state = nnx_side.from_checkpoint(linen.to_checkpoint(linen_state))
  return nnx.to_pure_dict(state) if pure else state
