"""Multi-process runs on this machine, as on a pod: 2 processes x 4 CPU devices.

Every run is `parity compare` started as subprocesses (parity/procs/launcher.py):
a loopback coordinator, gloo collectives, each process building only its
rows of every batch. Measured here (tiny preset, mesh data=2,fsdp=4):

* Linen and NNX are bit-identical across sides in 2 processes (losses and
  final state).
* 2 processes against 1 process on the same 8-device mesh: the final state
  is bit-identical; a step's reported loss may differ by 1 ULP. The loss is
  a sum over the batch shards of all 8 devices: in one process XLA:CPU's
  all-reduce adds the shards in its order, across processes gloo's
  all-reduce adds them in another (measured: 0 to 2 ULP per step with the
  suite's XLA flags, 0 or 1 without). The parameters' updates did not move
  by a bit in any run here, so the bound is on the reported loss only.
* Checkpoints written by 2 processes restore in 1 and the reverse, into
  either side, and the resumed runs end in the same final state bit for bit.
* A process killed during a save leaves no partial step behind.
* A declared pair (`--pair`, the stock classifier) is bit-identical across
  sides in 2 processes (warm: about 5 s); one whose states differ (a rename
  rule left out) is a verdict there as in one process: exit 1, each path
  named once, no report (about 4 s: nothing is compiled).

The runs judge numbers only (`--numbers-only`, as before) and skip the
program comparison they never judged (`--no-program-check`; programs are
compared in one process, tests/test_program_parity.py and tests/test_cli.py):
a warm 2-process run alone took 9.4 and 10.0 s with that flag, 10.7 and
11.5 s without (each step is traced once instead of twice).

The comparisons that share the module's runs are one xdist group, the two
runs that kill or inspect processes another; the launcher's own tests (small
commands, no jax) are in none. Every process of a run on this machine
writes its compiles to jax's persistent cache (parity/core/compat.py; jax itself
writes process 0's only, and on CPU process 1's keys differ), so a warm run
loads every program in both processes. Warm, in the full suite, the shared
runs took 20 s and the killed run 14 s (before that change: 37 s and 32 s).
The killed run's surviving process now ends at the launcher's SIGTERM
(parity/procs/distributed.py turns jax's preemption service off for runs on this
machine) instead of at its SIGKILL 5 s later: alone, warm, 6.5 s instead of
10.5 s.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from parity.procs import launcher

SHARED_RUNS = pytest.mark.xdist_group('multihost')
OWN_RUNS = pytest.mark.xdist_group('multihost-own-runs')

MESH = 'data=2,fsdp=4'
STEPS = 6
SAVE_EVERY = 3  # checkpoints after steps 2 and 5
TIMEOUT_S = 300
LOSS_BOUND_ULP = 2  # measured here: 2 (see the module docstring: the loss all-reduce order)


def _env():
  env = dict(os.environ)
  # The child processes set their own device count (the mesh's share per process).
  env['XLA_FLAGS'] = ' '.join(
      f for f in env.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')
  )
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _compare(tmp, name, *args, processes=1, expect=0):
  out = tmp / f'{name}.json'
  argv = [sys.executable, '-m', 'parity', 'compare', '--mesh', MESH, '--steps', str(STEPS),
          '--json', str(out), '--state-digest', '--numbers-only', '--no-program-check', *args]
  if processes > 1:
    argv += ['--processes', str(processes), '--timeout', str(TIMEOUT_S)]
  start = time.perf_counter()
  done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S + 60)
  assert done.returncode == expect, f'exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}'
  result = json.loads(out.read_text())
  result['wall_s'] = time.perf_counter() - start
  return result


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('multihost')
  two = _compare(tmp, 'two', '--checkpoint-every', str(SAVE_EVERY), '--checkpoint-dir', str(tmp / 'ck2'), processes=2)
  one = _compare(tmp, 'one', '--checkpoint-every', str(SAVE_EVERY), '--checkpoint-dir', str(tmp / 'ck1'))
  return tmp, two, one


def _ulp(a_hex: str, b_hex: str) -> int:
  """ULPs between two float32 losses reported as hex floats (parity.core.bitwise.max_ulp)."""
  import numpy as np

  from parity.core import bitwise

  return bitwise.max_ulp(*(np.float32(float.fromhex(h)) for h in (a_hex, b_hex)))


@pytest.mark.exhaustive
@SHARED_RUNS
def test_two_processes_are_bit_identical_across_sides(runs):
  _, two, _ = runs
  assert two['process_count'] == 2
  assert two['bitwise_equal'], two['verdict']
  assert two['linen']['loss_hex'] == two['nnx']['loss_hex']
  assert two['num_devices'] == 8


@pytest.mark.exhaustive
@SHARED_RUNS
def test_two_processes_train_as_one_process_does(runs):
  _, two, one = runs
  assert one['process_count'] == 1 and one['bitwise_equal']
  assert two['final_state_sha256'] == one['final_state_sha256']
  ulps = [_ulp(a, b) for a, b in zip(two['linen']['loss_hex'], one['linen']['loss_hex'])]
  assert max(ulps) <= LOSS_BOUND_ULP, ulps


@pytest.mark.exhaustive
@SHARED_RUNS
def test_a_two_process_checkpoint_resumes_in_one_process(runs):
  tmp, two, _ = runs
  # The NNX side's checkpoint, restored into both sides: Linen reads NNX's save too.
  resumed = _compare(tmp, 'two_to_one', '--resume-from', str(tmp / 'ck2' / 'nnx'), '--resume-step', '2')
  assert resumed['first_step'] == 3 and resumed['bitwise_equal']
  assert resumed['final_state_sha256'] == two['final_state_sha256']
  assert (two['init_side'], resumed['init_side']) == ('linen', None)  # neither side initialised it


@pytest.mark.exhaustive
@SHARED_RUNS
def test_a_one_process_checkpoint_resumes_in_two_processes(runs):
  tmp, _, one = runs
  resumed = _compare(tmp, 'one_to_two', '--resume-from', str(tmp / 'ck1' / 'linen'),
                     '--resume-step', '2', processes=2)
  assert resumed['process_count'] == 2 and resumed['bitwise_equal']
  assert resumed['final_state_sha256'] == one['final_state_sha256']


@pytest.mark.exhaustive
@SHARED_RUNS
def test_convert_reads_a_two_process_checkpoint(runs):
  tmp, _, _ = runs
  done = subprocess.run(
      [sys.executable, '-m', 'parity', 'convert', str(tmp / 'ck2' / 'linen'), str(tmp / 'converted'),
       '--to', 'nnx', '--step', '5', '--preset', 'tiny'],
      env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert (tmp / 'converted' / '5').is_dir()


@pytest.mark.exhaustive
@OWN_RUNS
def test_a_declared_pair_is_bit_identical_across_sides_in_two_processes(tmp_path):
  """`parity compare --pair ... --processes 2`: a user's pair (the stock classifier, whose
  sides put the whole batch from every process) on a mesh spanning both processes."""
  out = tmp_path / 'pair.json'
  pair = os.path.join(os.path.dirname(__file__), 'test_family_classifier.py') + ':classifier'
  done = subprocess.run(
      [sys.executable, '-m', 'parity', 'compare', '--pair', pair, '--mesh', 'data=8', '--steps', '2',
       '--json', str(out), '--numbers-only', '--no-program-check', '--processes', '2', '--timeout', str(TIMEOUT_S)],
      env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S + 60,
  )
  assert done.returncode == 0, f'exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}'
  result = json.loads(out.read_text())
  assert (result['process_count'], result['num_devices']) == (2, 8)
  assert result['first_divergent_step'] is None and result['metric_diffs'] == [[]] * 2, result['metric_diffs']
  assert result['state_diffs'] == []


@pytest.mark.exhaustive
def test_a_pair_whose_states_differ_is_a_verdict_in_two_processes(tmp_path):
  """A rename rule left out, run as 2 processes: exit 1 (a verdict, not a failed process),
  each path named once, by process 0, and no report; nothing is compiled."""
  (tmp_path / 'renamed.py').write_text(
      'import dataclasses\n'
      'from parity.pairs.stock_layout import Renames\n'
      'from tests import test_family_classifier as classifier\n\n'
      'def sides(mesh):\n'
      '  linen, nnx_side = classifier.make_sides(classifier.CFG, mesh)\n'
      "  rules = tuple(r for r in classifier.RENAMES.rules if r[0] != 'Dense_0')\n"
      '  return linen, dataclasses.replace(nnx_side, renames=Renames(rules), infer_renames=False)\n\n'
      'pair = dataclasses.replace(classifier.classifier, make_sides=sides)\n'
  )
  out = tmp_path / 'pair.json'
  env = _env()
  env['PYTHONPATH'] = os.pathsep.join(filter(None, (str(pathlib.Path(__file__).parents[1]), env.get('PYTHONPATH'))))
  done = subprocess.run(
      [sys.executable, '-m', 'parity', 'compare', '--pair', f'{tmp_path / "renamed.py"}:pair', '--mesh', 'data=2',
       '--steps', '2', '--json', str(out), '--processes', '2', '--timeout', str(TIMEOUT_S)],
      env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 60,
  )
  assert done.returncode == 1, f'exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}'
  assert done.stdout.count('verdict: STATES DIFFER (nothing trained)') == 1, done.stdout
  assert done.stdout.count('params/Dense_0/kernel: missing') == 1, done.stdout
  assert 'params/head/kernel: extra' in done.stdout
  assert 'failed' not in done.stderr and not out.exists(), done.stderr


# ---------------------------------------------------------------------------
# Failure handling (the launcher with small commands; no jax)
# ---------------------------------------------------------------------------

def _script(body: str) -> list[str]:
  return [sys.executable, '-c', body]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_a_failing_process_is_named_and_the_others_stopped(tmp_path):
  pidfile = tmp_path / 'pids'
  body = (
      'import os, sys, time\n'
      f'open({str(pidfile)!r}, "a").write(str(os.getpid()) + "\\n")\n'
      'i = int(os.environ["PARITY_PROCESS_ID"])\n'
      'print("process", i, "starting", flush=True)\n'
      'if i == 1:\n'
      '    time.sleep(0.5); print("boom: bad shard", flush=True); sys.exit(7)\n'
      'time.sleep(60)\n'
  )
  start = time.monotonic()
  with pytest.raises(launcher.LaunchError) as e:
    launcher.launch(_script(body), 3, timeout_s=30, stream=False, log_dir=str(tmp_path))
  assert time.monotonic() - start < 20
  assert [f.index for f in e.value.failures] == [1]
  assert 'process 1 exited with status 7' in str(e.value)
  assert 'boom: bad shard' in str(e.value)
  pids = [int(p) for p in pidfile.read_text().split()]
  assert len(pids) == 3 and not any(_alive(p) for p in pids)


@pytest.mark.exhaustive
def test_a_hung_process_is_killed_at_the_timeout_with_its_children(tmp_path):
  pidfile = tmp_path / 'pids'
  body = (
      'import os, subprocess, sys, time\n'
      'child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])\n'
      f'open({str(pidfile)!r}, "a").write(f"{{os.getpid()}} {{child.pid}}\\n")\n'
      'i = int(os.environ["PARITY_PROCESS_ID"])\n'
      'print("process", i, "waiting for a peer that never comes", flush=True)\n'
      'if i == 0:\n'
      '    sys.exit(0)\n'
      'time.sleep(120)\n'
  )
  with pytest.raises(launcher.LaunchError) as e:
    launcher.launch(_script(body), 2, timeout_s=3, stream=False, log_dir=str(tmp_path))
  assert [f.index for f in e.value.failures] == [1]
  assert 'process 1 hung (killed at the timeout)' in str(e.value)
  assert 'waiting for a peer that never comes' in str(e.value)
  pids = [int(p) for p in pidfile.read_text().split()]
  assert len(pids) == 4
  deadline = time.monotonic() + 5
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)  # a killed grandchild is reaped by init
  assert not any(_alive(p) for p in pids)


def test_a_verdict_is_not_a_failure_and_the_port_is_loopback(tmp_path):
  body = (
      'import os, sys\n'
      'assert os.environ["PARITY_COORDINATOR"].startswith("127.0.0.1:")\n'
      'sys.exit(1)\n'
  )
  with pytest.raises(launcher.Verdict) as e:
    launcher.launch(_script(body), 2, timeout_s=30, stream=False, verdict_codes=(1, 2), log_dir=str(tmp_path))
  assert e.value.code == 1


# ---------------------------------------------------------------------------
# A process killed during a save
# ---------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
  out = subprocess.run(['ps', '-o', 'pid=', '--ppid', str(pid)], capture_output=True, text=True)
  return [int(p) for p in out.stdout.split()]


@pytest.mark.exhaustive
@OWN_RUNS
def test_a_process_killed_while_saving_leaves_no_partial_checkpoint(tmp_path):
  """Process 1 is killed after the first committed save, while the next ones are written."""
  ckpt = tmp_path / 'ck'
  argv = [sys.executable, '-m', 'parity', 'compare', '--mesh', MESH, '--steps', '40',
          '--checkpoint-every', '1', '--checkpoint-dir', str(ckpt),
          '--numbers-only', '--no-program-check', '--processes', '2', '--timeout', str(TIMEOUT_S)]
  parent = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not (ckpt / 'nnx' / '0').is_dir():  # the first step committed by both sides
      assert parent.poll() is None and time.monotonic() < deadline, 'the run ended before its first save'
      time.sleep(0.05)
    workers = sorted(_children(parent.pid))
    assert len(workers) == 2
    # The launcher starts process 0 first; kill process 1 in the middle of the save loop.
    os.kill(workers[1], signal.SIGKILL)
    output, _ = parent.communicate(timeout=120)
  finally:
    if parent.poll() is None:
      parent.kill()
  assert parent.returncode == 3, output[-3000:]
  assert 'process 1 exited with status -9' in output
  assert not any(_alive(p) for p in workers)
  # Every step Orbax lists is whole; anything half-written is not a step.
  from parity.store import checkpoints

  for side in ('linen', 'nnx'):
    manager = checkpoints.open_manager(ckpt / side, create=False, read_only=True)
    steps = sorted(manager.all_steps())
    assert steps, side
    for step in steps:
      arrays = checkpoints.restore_arrays(manager, step)
      assert arrays['items'] and arrays['rng']
    listed = {str(s) for s in steps}
    extra = [p.name for p in (ckpt / side).iterdir() if p.name.isdigit() and p.name not in listed]
    assert not extra, f'{side}: step directories Orbax does not list: {extra}'
    manager.close()


# ---------------------------------------------------------------------------
# Small jax runs: nothing left behind, SIGTERM ends a process, the cache
# ---------------------------------------------------------------------------

# A process of a launched run: 2 CPU devices, joined through parity.procs.distributed.
JOIN_A_JAX_RUN = (
    'import os\n'
    'os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"\n'
    'from parity.procs import distributed\n'
    'assert distributed.initialize_from_env()\n'
)


@pytest.mark.exhaustive
@OWN_RUNS
def test_no_process_or_port_is_left_after_a_multi_process_jax_run(tmp_path):
  """Two processes join through the coordinator and exit; its port is free again."""
  port = launcher.free_port()
  body = (
      JOIN_A_JAX_RUN +
      'import jax\n'
      'print(os.getpid(), jax.process_index(), jax.process_count(), jax.device_count(), flush=True)\n'
  )
  logs = launcher.launch(_script(body), 2, timeout_s=120, stream=False, port=port, log_dir=str(tmp_path),
                         env=_env())
  lines = [open(log).read().split('\n') for log in logs]
  seen = [next(l for l in ls if l.count(' ') == 3 and l.split()[0].isdigit()).split() for ls in lines]
  assert [s[1:] for s in seen] == [['0', '2', '4'], ['1', '2', '4']]
  assert not any(_alive(int(s[0])) for s in seen)
  with socket.socket() as s:
    # Nothing listens there any more (connections the coordinator closed may
    # linger in TIME_WAIT, which SO_REUSEADDR allows; a listener would not be).
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((launcher.LOOPBACK, port))
    s.listen()


@pytest.mark.exhaustive
def test_a_process_of_a_jax_run_ends_at_the_launchers_sigterm(tmp_path):
  """SIGTERM, which the launcher sends to stop a failed run's processes, ends a jax process.

  jax's preemption service catches SIGTERM by default and the process goes
  on; parity.procs.distributed turns it off for runs on this machine. Without
  that, process 1 here would survive its SIGTERM and the run would pass.
  """
  body = (
      JOIN_A_JAX_RUN +
      'import signal, time\n'
      'import jax\n'
      'print("joined", jax.process_index(), flush=True)\n'
      'if jax.process_index() == 1:\n'
      '    os.kill(os.getpid(), signal.SIGTERM)\n'
      'time.sleep(30)\n'
      'print("survived", flush=True)\n'
  )
  with pytest.raises(launcher.LaunchError) as e:
    launcher.launch(_script(body), 2, timeout_s=120, stream=False, log_dir=str(tmp_path), env=_env())
  assert [(f.index, f.returncode) for f in e.value.failures] == [(1, -signal.SIGTERM)], str(e.value)
  assert 'survived' not in str(e.value)


@pytest.mark.exhaustive
@OWN_RUNS
def test_every_process_finds_its_programs_in_the_cache_on_the_next_run(tmp_path):
  """Process 1 loads its compiled programs on the next run, as process 0 does.

  jax writes the persistent cache from process 0 only, and on CPU each
  process's keys differ: without parity.core.compat.cache_compiles_of_every_process
  process 1 compiles every program on every run (measured: a warm 2-process
  `parity compare` took 18 s, 7.4 s with it).
  """
  body = (
      JOIN_A_JAX_RUN +
      'import jax, jax.numpy as jnp\n'
      'hits = []\n'
      'jax.monitoring.register_event_listener(\n'
      '    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)\n'
      'mesh = jax.make_mesh((4,), ("d",))\n'
      'x = jax.make_array_from_process_local_data(\n'
      '    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")), jnp.ones(2), (4,))\n'
      'total = jax.jit(lambda v: (v * 3).sum())(x)\n'
      'print("hits", jax.process_index(), len(hits), float(total), flush=True)\n'
  )
  env = _env()
  env['JAX_COMPILATION_CACHE_DIR'] = str(tmp_path / 'cache')

  def run(name):
    (tmp_path / name).mkdir()
    logs = launcher.launch(_script(body), 2, timeout_s=120, stream=False, log_dir=str(tmp_path / name), env=env)
    found = []
    for log in logs:
      line = next(l for l in pathlib.Path(log).read_text().split('\n') if l.startswith('hits '))
      found.append(line.split()[1:])
    return found

  first = run('first')
  assert [f[2] for f in first] == ['12.0', '12.0']
  second = run('second')
  assert [f[0] for f in second] == ['0', '1']
  assert all(int(f[1]) >= 1 for f in second), f'cache hits per process on the second run: {second}'
