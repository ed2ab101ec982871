"""Start N processes of one command on this machine, as a pod starts one per host.

Each process gets the multi-controller environment `parity.procs.distributed`
reads: the coordinator address (a free port on the loopback interface: the
processes never listen beyond this machine), the process count and its own
index. Process 0's output is streamed to this process's stdout as it comes;
every process's output is kept in a log file.

If a process exits non-zero, or the whole run passes `timeout_s`, every
other process is stopped (SIGTERM to its process group, then SIGKILL after
a grace period), and the failure names each failed or hung process with its
index, its exit status and the last lines of its output. Nothing is left
running: each process leads its own process group, and every group is
killed before `launch` returns, on success, failure, timeout or interrupt.
jax is never imported here.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

COORDINATOR = 'PARITY_COORDINATOR'
NUM_PROCESSES = 'PARITY_NUM_PROCESSES'
PROCESS_ID = 'PARITY_PROCESS_ID'
LOOPBACK = '127.0.0.1'
GRACE_S = 5.0
TAIL_LINES = 15


class LaunchError(RuntimeError):
  """Some process failed or hung; the message names each with its last output."""

  def __init__(self, message: str, failures: list['ProcessFailure']):
    super().__init__(message)
    self.failures = failures


class Verdict(Exception):
  """Process 0 exited with one of the `verdict_codes` (and no process failed): its code."""

  def __init__(self, code: int):
    super().__init__(f'exit status {code}')
    self.code = code


@dataclasses.dataclass
class ProcessFailure:
  index: int
  returncode: int | None  # None: still running at the timeout (hung), then killed
  tail: str

  def describe(self) -> str:
    what = 'hung (killed at the timeout)' if self.returncode is None else f'exited with status {self.returncode}'
    tail = '\n'.join('    ' + line for line in self.tail.splitlines()) or '    (no output)'
    return f'process {self.index} {what}; its last output:\n{tail}'


def free_port() -> int:
  """A TCP port free on the loopback interface now (the coordinator binds it next)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((LOOPBACK, 0))
    return s.getsockname()[1]


def _tail(path: str, lines: int = TAIL_LINES) -> str:
  try:
    with open(path, 'rb') as f:
      text = f.read().decode('utf-8', 'replace')
  except OSError:
    return ''
  return '\n'.join(text.rstrip('\n').splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def _stop_all(procs: Sequence[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      _kill_group(p, signal.SIGTERM)
  deadline = time.monotonic() + GRACE_S
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for p in procs:
    _kill_group(p, signal.SIGKILL)  # the whole group: children of a worker too
    if p.poll() is None:
      p.wait()


def launch(
    argv: Sequence[str],
    num_processes: int,
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    per_process_env: Sequence[Mapping[str, str]] | None = None,
    log_dir: str | None = None,
    stream: bool = True,
    verdict_codes: Sequence[int] = (),
    port: int | None = None,
) -> list[str]:
  """Runs `argv` as `num_processes` processes; returns each one's log file path.

  Raises LaunchError if any process fails or the run exceeds `timeout_s`.
  An exit status in `verdict_codes` is a command's answer, not a failure:
  once every process has exited with 0 or such a status, Verdict carries
  process 0's. `port`: the coordinator's port (default: a free one).
  """
  if num_processes < 1:
    raise ValueError(f'num_processes must be at least 1, got {num_processes}')
  log_dir = log_dir or tempfile.mkdtemp(prefix='parity-processes-')
  coordinator = f'{LOOPBACK}:{port or free_port()}'
  procs: list[subprocess.Popen] = []
  logs = [os.path.join(log_dir, f'process-{i}.log') for i in range(num_processes)]
  files = []
  try:
    for i in range(num_processes):
      child_env = dict(os.environ if env is None else env)
      child_env.update({COORDINATOR: coordinator, NUM_PROCESSES: str(num_processes), PROCESS_ID: str(i)})
      if per_process_env is not None:
        child_env.update(per_process_env[i])
      f = open(logs[i], 'wb')
      files.append(f)
      procs.append(subprocess.Popen(
          list(argv), env=child_env, stdout=f, stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL, start_new_session=True,
      ))
    deadline = time.monotonic() + timeout_s
    shown = 0
    while True:
      if stream:
        shown = _stream(logs[0], shown)
      codes = [p.poll() for p in procs]
      failed = [i for i, c in enumerate(codes) if c not in (None, 0, *verdict_codes)]
      if failed:
        time.sleep(0.5)  # let the others' last words reach their logs
        _stop_all(procs)
        failures = [ProcessFailure(i, procs[i].returncode, _tail(logs[i])) for i in failed]
        raise LaunchError(_message(failures, f'{len(failed)} of {num_processes} processes failed'), failures)
      if all(c is not None for c in codes):
        if stream:
          _stream(logs[0], shown)
        if codes[0] != 0:
          raise Verdict(codes[0])
        return logs
      if time.monotonic() > deadline:
        hung = [i for i, c in enumerate(codes) if c is None]
        _stop_all(procs)
        failures = [ProcessFailure(i, None, _tail(logs[i])) for i in hung]
        raise LaunchError(
            _message(failures, f'timeout after {timeout_s:g} s: {len(hung)} of {num_processes} processes still running'),
            failures,
        )
      time.sleep(0.1)
  finally:
    _stop_all(procs)
    for f in files:
      f.close()


def _stream(path: str, shown: int) -> int:
  try:
    with open(path, 'rb') as f:
      f.seek(shown)
      chunk = f.read()
  except OSError:
    return shown
  if chunk:
    sys.stdout.write(chunk.decode('utf-8', 'replace'))
    sys.stdout.flush()
  return shown + len(chunk)


def _message(failures: list[ProcessFailure], head: str) -> str:
  return head + '\n' + '\n'.join(f.describe() for f in failures)
