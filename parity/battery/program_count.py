"""Every XLA program a battery asks for, by the part that asked: the plugin's `--parity-programs`.

A pair's cost is the programs its parts compile. With the option, each test
records the programs jax hands XLA while it runs (its function, the devices it
spans, seconds, and a digest of its text), and the session ends with a table:
per test, each program, and whether an earlier test asked for the same one.
A program asked for twice is compiled twice (or loaded from the persistent
cache twice): the count to drive to one per (side, function, placement).
Nothing here imports jax at import time.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Iterator


@dataclasses.dataclass(frozen=True)
class Program:
  """One request for a program: what asked (a test id), which function, how many devices, seconds."""

  asker: str
  function: str
  fingerprint: str
  devices: int
  seconds: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class Recorder:
  """Collects `Program`s while active (`recording(asker)`)."""

  def __init__(self):
    self.programs: list[Program] = []
    self.askers: list[str] = []  # every test recorded, in order (some ask for no program)
    self._asker = '(collection)'
    self._hook = None

  def start(self) -> None:
    from parity.core import compat  # imports jax: only once a test runs

    if self._hook is None:
      self._hook = compat.on_backend_compile(self._seen)
      self._hook.__enter__()

  def stop(self) -> None:
    if self._hook is not None:
      self._hook.__exit__(None, None, None)
      self._hook = None

  @contextlib.contextmanager
  def recording(self, asker: str) -> Iterator[None]:
    self.askers.append(asker)
    previous, self._asker = self._asker, asker
    try:
      yield
    finally:
      self._asker = previous

  def _seen(self, function: str, fingerprint: str, devices: int, seconds: float) -> None:
    self.programs.append(Program(self._asker, function, fingerprint, devices, round(seconds, 3)))


def table(programs: Iterable[Program], askers: Iterable[str] = ()) -> list[str]:
  """The report: one line per program in the order asked, each marked where an earlier request
  asked for the same program (compiled again, or loaded from the persistent cache: XLA's seconds
  tell which), then the tests of `askers` that asked for none, then the totals."""
  programs = list(programs)
  first: dict[str, str] = {}
  lines, repeated, seconds = [], 0, 0.0
  asker = None
  for p in programs:
    if p.asker != asker:
      asker = p.asker
      lines.append(f'{asker}: {sum(q.asker == asker for q in programs)} program(s)')
    again = first.get(p.fingerprint)
    if again is None:
      first[p.fingerprint] = p.asker
    else:
      repeated += 1
    seconds += p.seconds
    lines.append(f'  {p.function:<40} {p.devices:>2} device(s) {p.seconds:>8.3f} s  {p.fingerprint}'
                 + ('' if again is None else f'  (the same program as in {again})'))
  asked = {p.asker for p in programs}
  none = [a for a in dict.fromkeys(askers) if a not in asked]
  if none:
    lines.append(f'{len(none)} test(s) asked for no program (every one they ran was compiled already):')
    lines += [f'  {a}' for a in none]
  lines.append(f'{len(programs)} programs asked for ({len(first)} distinct, {repeated} asked for again),'
               f' {seconds:.1f} s in XLA (compiling, or loading from the persistent cache)')
  return lines
