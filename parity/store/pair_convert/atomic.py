"""A conversion is all or nothing: errors, partial directories, signals, fsync and the move into place."""
from __future__ import annotations

import os
import re
import shutil
import signal
from typing import Any


class ConvertError(ValueError):
  """Bad input to the converter: one clear message, nothing written."""


class Interrupted(ConvertError):
  """SIGTERM or Ctrl-C arrived mid-conversion (the temporary output is removed)."""


NOTHING_WRITTEN = 'nothing written to DST, SRC untouched'
_REPLACED = '-replaced'  # the old DST, renamed aside by the swap of `overwrite`
_REMOVING = '-removing'  # the old DST once the swap is done, being removed (never put back)


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _write_failure(error: BaseException) -> str:
  """The first line of a failure to write, less tensorstore's spec (a long JSON)."""
  return re.sub(r" \[tensorstore_spec='.*?'\]", '', _first_line(error))


def _partial_prefix(dst: str) -> str:
  """The name of a conversion's temporary directory beside DST, less the converting process's id."""
  return os.path.join(os.path.dirname(dst), f'.{os.path.basename(dst)}.partial-')


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _stale_partials(dst: str) -> list[tuple[str, bool]]:
  """[(path, is an old DST put aside)] left next to `dst` by conversions no longer running."""
  prefix = _partial_prefix(dst)
  parent, base = os.path.split(prefix)
  if not os.path.isdir(parent):
    return []
  out = []
  for name in sorted(os.listdir(parent)):
    if not name.startswith(base):
      continue
    pid = name[len(base):]
    replaced = pid.endswith(_REPLACED)
    pid = pid[: -len(_REPLACED)] if replaced else pid.removesuffix(_REMOVING)
    if not pid.isdigit() or (_pid_alive(int(pid)) and int(pid) != os.getpid()):
      continue  # another conversion's, still running (or not ours to judge)
    out.append((os.path.join(parent, name), replaced))
  return out


def restore_replaced(dst: str) -> str | None:
  """Puts an old DST back that a swap killed between its two renames left aside; returns where it was."""
  if os.path.lexists(dst):
    return None
  aside = [path for path, replaced in _stale_partials(dst) if replaced]
  if not aside:
    return None
  old = max(aside, key=lambda path: os.lstat(path).st_ctime)  # the latest swap's
  try:
    os.rename(old, dst)
  except OSError as e:
    raise ConvertError(
        f'DST {dst} is missing and the old DST, put aside in {old} by a conversion that was killed,'
        f' cannot be moved back: {e.strerror}'
    ) from None
  return old


def remove_stale_partials(dst: str) -> list[str]:
  """Removes temporary directories left by conversions to `dst` that were killed,
  and old DSTs they put aside (once DST exists)."""
  removed = []
  for path, replaced in _stale_partials(dst):
    if replaced and not os.path.lexists(dst):
      continue  # the only copy of DST: restore_replaced puts it back
    shutil.rmtree(path, ignore_errors=True)
    removed.append(path)
  return removed


def check_dst(src: str, dst: str, overwrite: bool) -> None:
  """Refuses a DST that overlaps SRC, has no parent directory, is not a directory, or is not empty
  (unless `overwrite`)."""
  src_real, dst_real = os.path.realpath(src), os.path.realpath(dst)
  if dst_real == src_real or dst_real.startswith(src_real + os.sep) or src_real.startswith(dst_real + os.sep):
    raise ConvertError(f'DST {dst} and SRC {src} overlap; DST must be outside SRC')
  parent = os.path.dirname(dst_real)
  if not os.path.isdir(parent):
    raise ConvertError(f'DST parent directory {parent} does not exist')
  if os.path.lexists(dst):
    if not os.path.isdir(dst) or os.path.islink(dst):
      raise ConvertError(f'DST {dst} exists and is not a directory')
    if os.listdir(dst) and not overwrite:
      raise ConvertError(f'DST {dst} is not empty; pass --overwrite to replace it')


def make_partial(dst: str) -> str:
  """The conversion's temporary directory beside DST, made (stale ones of killed conversions removed)."""
  remove_stale_partials(dst)
  tmp = _partial_prefix(dst) + str(os.getpid())
  try:
    os.makedirs(tmp)
  except OSError as e:
    raise ConvertError(f'DST {dst} is not writable: {e.strerror}: {e.filename}') from None
  return tmp


class _Signals:
  """SIGTERM raises Interrupted in the main thread, so temporary output is removed.

  `moved`: DST holds the conversion now (an Interrupted says so).
  """

  def __init__(self):
    self.moved = False

  def interrupted(self, signum: int) -> Interrupted:
    if self.moved:
      return Interrupted(
          f'interrupted by signal {signum} after the conversion was moved into place; DST holds it, SRC untouched'
      )
    return Interrupted(f'interrupted by signal {signum}; {NOTHING_WRITTEN}')

  def __enter__(self):
    self.previous = None
    if hasattr(signal, 'SIGTERM') and _in_main_thread():
      self.previous = signal.signal(signal.SIGTERM, self._raise)
    return self

  def _raise(self, signum, frame):
    del frame
    raise self.interrupted(signum)

  def __exit__(self, *exc):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)
    return False


class _HeldSignals:
  """SIGTERM and SIGINT wait until the block ends (it is never cut in half), then raise Interrupted.

  Not a signal mask: a mask holds a signal back from one thread only, and the
  kernel then hands it to another (tensorstore's); Python runs every handler
  in the main thread anyway, so these handlers just note the signal.
  """

  def __init__(self, signals: _Signals):
    self.signals = signals
    self.caught: list[int] = []
    self.previous: dict[int, Any] = {}

  def __enter__(self):
    if _in_main_thread():
      for sig in (getattr(signal, 'SIGTERM', None), signal.SIGINT):
        if sig is not None and signal.getsignal(sig) not in (signal.SIG_IGN, None):  # not ignored
          self.previous[sig] = signal.signal(sig, lambda signum, frame: self.caught.append(signum))
    return self

  def __exit__(self, exc_type, exc, tb):
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)
    if self.caught and exc_type is None:
      raise self.signals.interrupted(self.caught[0])
    return False


def _in_main_thread() -> bool:
  import threading

  return threading.current_thread() is threading.main_thread()


def _fsync_tree(root: str) -> None:
  """Data reaches the disk before the rename makes it visible."""
  for parent, _, files in os.walk(root):
    for name in files:
      fd = os.open(os.path.join(parent, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)


def _move_into_place(tmp: str, dst: str) -> str | None:
  """Renames `tmp` to `dst`; returns where the old DST was put aside, to remove (None if none).

  If the second rename fails, the old DST goes back; if that fails too, a
  ConvertError says where the old DST is (DST is then absent).
  """
  old, emptied = None, False
  if os.path.lexists(dst):
    if os.listdir(dst):
      old = _partial_prefix(dst) + f'{os.getpid()}{_REPLACED}'
      os.rename(dst, old)
    else:
      os.rmdir(dst)
      emptied = True
  try:
    os.rename(tmp, dst)
  except BaseException as e:
    if old is not None:
      try:
        os.rename(old, dst)
      except OSError as back:
        raise ConvertError(
            f'moving the conversion into DST failed: {_write_failure(e)}, and putting the old DST'
            f' back failed: {_write_failure(back)}; the old DST is at {old}: rename it to DST (the'
            ' next conversion to DST does while DST is absent); SRC untouched'
        ) from None
    elif emptied:
      os.mkdir(dst)
    raise
  if old is not None:  # from here on a leftover of it is only removed, never put back
    removing = old[: -len(_REPLACED)] + _REMOVING
    try:
      os.rename(old, removing)
      old = removing
    except OSError:
      pass  # DST holds the conversion; removed below as it is
  return old


def move_into_place(tmp: str, dst: str, signals: _Signals, overwrite: bool = False) -> None:
  """`tmp` renamed to DST (with `overwrite`, a non-empty old DST renamed aside first, then removed),
  SIGTERM and Ctrl-C held during the renames; from then on `signals.moved`."""
  with _HeldSignals(signals):
    if not overwrite and os.path.lexists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
      raise ConvertError(f'DST {dst} appeared while converting; {NOTHING_WRITTEN}')
    old = _move_into_place(tmp, dst)
    signals.moved = True
  # A signal held back raised above; one from here on finds DST holding the conversion.
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def cleanup_after(error: BaseException, signals: _Signals, tmp: str, dst: str, stage: str) -> BaseException:
  """What a conversion raises for `error` once its partial output is gone (`stage`: what it was doing)."""
  from parity.core.errors import TreeMismatchError

  if signals.moved:
    for path, _ in _stale_partials(dst):  # the old DST of `overwrite`, put aside
      if path.endswith((f'{os.getpid()}{_REMOVING}', f'{os.getpid()}{_REPLACED}')):
        shutil.rmtree(path, ignore_errors=True)
    return signals.interrupted(signal.SIGINT) if isinstance(error, KeyboardInterrupt) else error
  shutil.rmtree(tmp, ignore_errors=True)
  if isinstance(error, (OSError, ValueError)) and not isinstance(error, (ConvertError, TreeMismatchError)):
    return ConvertError(f'{stage} failed: {_write_failure(error)}; {NOTHING_WRITTEN}')
  return error
