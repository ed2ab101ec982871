"""A record's files: text tables one line per entry (made to be committed and diffed), the common
start's values, the train step's program, and `record.json` saying what the record is and where
it was taken. A file that is missing or cannot be read fails with its name."""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np

FORMAT = 1
MANIFEST = 'record.json'
START = 'start.npz'  # the common start's values, which every recorded run begins from
PROGRAM = 'program.mlir.gz'  # the train step as the program part compares it (StableHLO, debug info)
CANONICAL = 'program.txt'  # its canonical form, to read and diff
# One table per part: `key<TAB>dtype[shape]<TAB>value` lines.
TABLES = ('structure', 'specs', 'init', 'grads', 'train', 'eval', 'decode', 'mesh')
ACTIVATIONS = 'activations.jsonl'  # the train step's activation constraints, one row a line
LAYOUTS = 'layouts.json'  # the side's own checkpoint layouts, leaf by leaf (`parity convert` reads them)


class RecordError(ValueError):
  """A record that is missing, corrupt or of another format: the message names the file."""


def table_name(part: str) -> str:
  return f'{part}.txt'


def write_table(directory: pathlib.Path, part: str, sections: Mapping[str, Sequence[tuple[str, str, str]]]) -> None:
  """`sections` (a qualifier such as 'from=linen' -> entries) as one table: a `[qualifier]` line
  before each section's entries."""
  lines = []
  for qualifier, entries in sections.items():
    lines.append(f'[{qualifier}]')
    lines += ['\t'.join(entry) for entry in entries]
  (directory / table_name(part)).write_text('\n'.join(lines) + '\n')


def _scrubbed(text: str) -> str:
  """Lowered text with each debug location's file named by its file name alone (no directory of
  the machine it was recorded on)."""
  return re.sub(r'loc\("(?:[^"]*/)([^"/]+)":', r'loc("\1":', text)


@dataclasses.dataclass
class Record:
  """A record read from its directory (`read`), or being written (`Writer`)."""

  directory: pathlib.Path
  manifest: dict[str, Any]

  @property
  def name(self) -> str:
    return str(self.directory)

  def _path(self, file: str) -> pathlib.Path:
    path = self.directory / file
    if not path.is_file():
      raise RecordError(f'record {self.directory}: {file} is missing (the record is incomplete: take it again,'
                        ' parity record)')
    return path

  def table(self, part: str) -> dict[str, list[tuple[str, str, str]]]:
    """The part's sections, qualifier -> entries."""
    path = self._path(table_name(part))
    sections: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if line.startswith('[') and line.endswith(']'):
        current = sections.setdefault(line[1:-1], [])
        continue
      fields = line.split('\t')
      if current is None or len(fields) != 3:
        raise RecordError(f'record {path}: line {number} is not `key<TAB>dtype[shape]<TAB>value` under a'
                          f' [section] line: {line[:120]!r} (a corrupt record: take it again)')
      current.append(tuple(fields))
    return sections

  def start(self) -> dict[str, np.ndarray]:
    path = self._path(START)
    try:
      with np.load(path, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}
    except Exception as e:  # noqa: BLE001 (a corrupt file: named, with what numpy said)
      raise RecordError(f'record {path}: cannot be read ({type(e).__name__}: {e})') from None

  def program(self) -> str:
    path = self._path(PROGRAM)
    try:
      return gzip.decompress(path.read_bytes()).decode()
    except Exception as e:  # noqa: BLE001
      raise RecordError(f'record {path}: cannot be read ({type(e).__name__}: {e})') from None

  def layouts(self) -> dict[str, Any]:
    """The side's own checkpoint layouts by format (parity.store.pair_convert.layouts.Layout, without
    the abstract tree: what converting a checkpoint of the deleted side reads)."""
    from parity.store.pair_convert.layouts import Layout, Leaf

    path = self._path(LAYOUTS)
    try:
      data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise RecordError(f'record {path}: not JSON ({e})') from None

    def keys(k):
      return tuple((str(name), int(kind)) for name, kind in k)

    return {fmt: Layout(
        layout['role'], fmt,
        tuple(Leaf(l['disk'], l['native'], l['checkpoint'], tuple(l['shape']), np.dtype(l['dtype']), keys(l['keys']),
                   l['typed_key']) for l in layout['leaves']),
        tuple((keys(k), t) for k, t in layout['empties']), tuple(keys(k) for k in layout['order']), None)
        for fmt, layout in data.items()}

  def activations(self) -> list[dict[str, Any]]:
    path = self._path(ACTIVATIONS)
    try:
      return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:
      raise RecordError(f'record {path}: not one JSON row a line ({e})') from None


def read(directory: str | os.PathLike) -> Record:
  """The record in `directory`, its manifest checked."""
  directory = pathlib.Path(directory)
  path = directory / MANIFEST
  if not directory.is_dir():
    raise RecordError(f'record {directory}: no such directory (take one with `parity record --pair'
                      ' FILE.py:NAME --side linen OUT`)')
  if not path.is_file():
    raise RecordError(f'record {directory}: no {MANIFEST} (not a record, or an incomplete one)')
  try:
    manifest = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise RecordError(f'record {path}: not JSON ({e})') from None
  if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
    raise RecordError(f'record {path}: format {manifest.get("format") if isinstance(manifest, dict) else None!r},'
                      f' where this kit reads format {FORMAT}: take the record again with this kit')
  return Record(directory, manifest)


class Writer:
  """Writes a record into a fresh directory beside `out`, moved into place when complete: a run
  that fails leaves any earlier record at `out` as it was."""

  def __init__(self, out: str | os.PathLike):
    self.out = pathlib.Path(out)
    self.out.parent.mkdir(parents=True, exist_ok=True)
    self.directory = pathlib.Path(tempfile.mkdtemp(prefix=f'.{self.out.name}.', dir=self.out.parent))

  def start(self, flat: Mapping[str, Any]) -> None:
    np.savez(self.directory / START, **{k: np.asarray(v) for k, v in flat.items()})

  def program(self, text: str, canonical: str) -> None:
    (self.directory / PROGRAM).write_bytes(gzip.compress(_scrubbed(text).encode(), mtime=0))
    (self.directory / CANONICAL).write_text(canonical)

  def activations(self, rows: Sequence[Mapping[str, Any]]) -> None:
    (self.directory / ACTIVATIONS).write_text(''.join(json.dumps(r, sort_keys=True) + '\n' for r in rows))

  def layouts(self, layouts: Mapping[str, Any]) -> None:
    data = {fmt: {'role': layout.role,
                  'leaves': [{'disk': l.disk, 'native': l.native, 'checkpoint': l.checkpoint, 'shape': list(l.shape),
                              'dtype': np.dtype(l.dtype).name, 'keys': [list(k) for k in l.keys],
                              'typed_key': l.typed_key} for l in layout.leaves],
                  'empties': [[[list(k) for k in keys], t] for keys, t in layout.empties],
                  'order': [[list(k) for k in keys] for keys in layout.order]}
            for fmt, layout in layouts.items()}
    (self.directory / LAYOUTS).write_text(json.dumps(data, indent=1) + '\n')

  def table(self, part: str, sections: Mapping[str, Sequence[tuple[str, str, str]]]) -> None:
    write_table(self.directory, part, sections)

  def finish(self, manifest: Mapping[str, Any]) -> Record:
    (self.directory / MANIFEST).write_text(json.dumps({'format': FORMAT, **manifest}, indent=1, sort_keys=True) + '\n')
    old = None
    if self.out.exists():
      old = self.out.with_name(f'.{self.out.name}.old')
      shutil.rmtree(old, ignore_errors=True)
      self.out.rename(old)
    self.directory.rename(self.out)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    return read(self.out)

  def abandon(self) -> None:
    shutil.rmtree(self.directory, ignore_errors=True)


def size(directory: str | os.PathLike) -> int:
  """The record's bytes on disk."""
  return sum(p.stat().st_size for p in pathlib.Path(directory).rglob('*') if p.is_file())
