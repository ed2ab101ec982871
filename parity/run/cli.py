"""`parity`: spec tables, side-by-side runs and checkpoint conversion of the Linen and NNX implementations.

Exit status: 0 equal (or converted), 1 the sides differ, 2 bad input (or out
of memory, or a conversion that could not write or was interrupted), 3 a
process of `--processes N` failed or hung.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Sequence

from parity.core.errors import BadInput  # noqa: F401  (raised by the commands, caught by main)

from parity.run.reference import reference_decoder


def cmd_specs(args) -> int:
  """`parity specs`: the reference decoder's spec tables, or with `--pair` a declared pair's."""
  if args.pair:
    from parity.run import pair_specs

    pair = _load_pair(args.pair)
    if args.activations and pair.activations_resolved and not args.mesh and pair.meshes:
      args.mesh = pair.meshes[0]  # compared on its devices: asked for before jax starts
      prepare_xla(args)
    return pair_specs.command(args, pair)
  args.preset = args.preset or 'default'
  args.scenario = args.scenario or '01_baseline'
  return reference_decoder().specs_command(args)


def _mesh(spec: str | None, pair=None):
  """The mesh of a `--mesh` spec over all devices (a pair's own `mesh_factory` where it has
  one); a spec that does not fit is bad input."""
  if not spec:
    return None
  from parity.core import specs

  try:
    return specs.make_mesh(spec) if pair is None else pair.mesh(spec)
  except ValueError as e:
    raise BadInput(str(e)) from None


def prepare_xla(args) -> None:
  """XLA flags this command needs, set before jax starts its backends.

  `--mesh` with N devices: N CPU devices (the host-platform device count;
  only the CPU backend reads it), unless XLA_FLAGS already sets a count.
  `compare`: deterministic GPU kernels unless `--nondeterministic-gpu`
  (only the GPU backend reads them).
  """
  from parity.env import xla_env

  if xla_env.backends_started():  # called in-process after jax started: too late to change
    return
  flags = []
  mesh = getattr(args, 'mesh', None)
  if mesh:
    from parity.core import specs

    try:
      sizes = specs.parse_mesh_spec(mesh)
    except ValueError as e:
      raise BadInput(str(e)) from None
    count = math.prod(sizes.values())
    if _in_worker():  # each process has its share of the mesh's devices
      from parity.procs import distributed

      count //= distributed.env_process()[1]
    flags.append(xla_env.host_device_count_flag(count))
  if args.command == 'compare' and not args.nondeterministic_gpu:
    flags.extend(xla_env.GPU_DETERMINISTIC_FLAGS)
  added = xla_env.add_flags(flags)
  count_flag = xla_env.flag_name(xla_env.host_device_count_flag(0))
  # (A worker must not start jax's backends before joining the run.)
  if mesh and not _in_worker() and any(xla_env.flag_name(f) == count_flag for f in added):
    import jax

    if jax.default_backend() == 'cpu':
      print(
          f'parity: mesh {mesh} on CPU: {count} CPU devices ({added[0]} set for this run)',
          file=sys.stderr,
      )


def _check_output(path: str | None, option: str) -> None:
  """Fails before the run, not after it, when an output file cannot be written."""
  import os

  if path is None:
    return
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise BadInput(f'{option} {path}: directory {parent} does not exist')


def cmd_compare(args) -> int:
  _refuse_reference_options(args)
  if args.resume_from is not None and args.init is not None:
    raise BadInput('--init chooses the side that initialises a fresh run; with --resume-from'
                   ' both sides restore the checkpoint')
  args.preset = args.preset or 'tiny'
  args.scenario = args.scenario or '01_baseline'
  args.init = args.init or 'linen'
  if args.processes > 1 and not _in_worker():
    _the_pair(args)  # bad input (no pair, no reference) once, before any process starts
    return _launch_processes(args)
  from parity.core.errors import TreeMismatchError
  from parity.pairs import adapter
  from parity.run import report as report_lib
  from parity.run import runner

  if args.steps < 1:
    raise BadInput(f'--steps must be at least 1, got {args.steps}')
  if args.decode < 0:
    raise BadInput(f'--decode must be 0 (no decoding) or more tokens, got {args.decode}')
  if args.checkpoint_every < 0:
    raise BadInput(f'--checkpoint-every must be 0 (no saves) or more, got {args.checkpoint_every}')
  for path, option in ((args.json, '--json'), (args.markdown, '--markdown'), (args.plot, '--plot')):
    _check_output(path, option)
  if args.plot:
    try:
      import matplotlib  # noqa: F401
    except ImportError:
      raise BadInput(
          "--plot needs matplotlib: pip install 'linen-nnx-parity[report]'"
      ) from None
  pair = _the_pair(args)
  mesh = _mesh(args.mesh, pair)

  progress = report_lib.Progress(args.steps)
  options = dict(
      on_step=progress.step, on_phase=progress.phase, mesh=mesh,
      checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
      state_digest=args.state_digest, resume_from=_resume(args),
      program_diff=not args.no_program_check,
  )
  if args.decode:
    if pair.decode is None:
      raise BadInput(f'--decode: pair {pair.name} declares no decoding (Pair(decode=parity.Decode(...)))')
    options.update(decode_steps=args.decode, decode_prompt=pair.decode.prompt(pair.batch(0, 'eval')))
  try:
    # The pair's parts choose what its comparison covers, as they choose its battery.
    from parity.battery.parts import PARTS

    parts = set(PARTS if pair.parts is None else pair.parts)
    sides = adapter.make_pair_sides(pair, mesh)

    # Verdicts, not bad input: the sides are not the same program, so nothing is trained.
    checks = [('states', lambda: adapter.check_structure(pair.name, *sides))]
    if 'specs' in parts:  # the parameters' annotations, as the battery's specs part reads them
      from parity.battery import checks as battery

      checks.append(('specs', lambda: battery.check_param_specs(pair, *sides)))
    for what, check in checks:
      try:
        check()
      except (TreeMismatchError, AssertionError) as e:
        print(f'{e}\nverdict: {what.upper()} DIFFER (nothing trained)')
        if args.json or args.markdown or args.plot:
          print(f'parity: no report written: the {what} differ, so nothing was trained', file=sys.stderr)
        return 1
    result = runner.compare_pair(pair, args.steps, sides=sides, seed=args.seed, init_side=args.init, **options)
  except (adapter.BatchError, adapter.SideError) as e:
    raise BadInput(str(e)) from None
  except TreeMismatchError as e:  # the resumed checkpoint is not the state of these sides
    if args.resume_from is None:
      raise
    raise BadInput(f'--resume-from {args.resume_from}: {e}') from None
  except Exception as e:  # XLA's runtime error type moved between jax versions
    message = out_of_memory_message(e, args)
    if message is None:
      raise
    raise BadInput(message) from None
  report = report_lib.Report(result, *(result.title or (f'pair {pair.name}', '-')), args.mesh)
  import jax

  if jax.process_index() == 0:  # one report for the whole run
    print(report.text(), end='')
    for diff in result.state_diffs[:20]:
      print(f'  final state: {diff}')
    if args.json:
      report.write_json(args.json)
    if args.markdown:
      report.write_markdown(args.markdown)
    if args.plot:
      report.plot(args.plot)
  if not result.bitwise_equal:
    return 1
  if not (args.numbers_only or result.same_program):
    what = [f'{name}: {verdict}' for name, verdict in (
        ('train-step memory', result.memory_verdict), ('train-step program', result.program_verdict))
        if verdict.startswith('differs')]
    if result.decode is not None and not result.decode.same_program:
      what.append('the decoding step')
    print(f'parity: the numbers match but not the program ({"; ".join(what) or "see above"});'
          ' --numbers-only compares the numbers alone', file=sys.stderr)
    return 1
  return 0


def _refuse_reference_options(args) -> None:
  if args.pair and (args.preset, args.scenario) != (None, None):
    raise BadInput("--preset and --scenario choose the reference decoder's pair;"
                   ' a --pair brings its own model and data')


def _the_pair(args):
  """The pair a command runs: `--pair`'s, or the reference decoder's of `--preset` and
  `--scenario` (bridge/reference.py `pair`; default tiny, 01_baseline)."""
  if args.pair:
    return _load_pair(args.pair)
  return reference_decoder().pair(args.preset or 'tiny', args.scenario or '01_baseline', getattr(args, 'seed', 0))


def _put_on_path(file: str) -> None:
  """Where pytest's default import mode puts a test file's root: the file's own
  directory, or above its package (the first directory up without an
  `__init__.py`), first on `sys.path`, so the file imports its sibling modules
  under `parity compare` as it does under pytest."""
  import os

  root = os.path.dirname(os.path.abspath(file))
  while os.path.isfile(os.path.join(root, '__init__.py')):
    root = os.path.dirname(root)
  if root not in sys.path:
    sys.path.insert(0, root)


def _load_pair(spec: str):
  """The `Pair` named by `FILE.py:NAME` or `module.path:NAME`."""
  import importlib
  import importlib.util
  import os

  from parity.pairs import adapter

  where, sep, name = spec.rpartition(':')
  if not sep or not where or not name:
    raise BadInput(f'--pair {spec}: expected FILE.py:NAME or module:NAME')
  try:
    if where.endswith('.py'):
      if not os.path.isfile(where):
        raise BadInput(f'--pair {spec}: no file {where}')
      _put_on_path(where)
      module_spec = importlib.util.spec_from_file_location(f'_parity_pair_{abs(hash(where))}', where)
      module = importlib.util.module_from_spec(module_spec)
      # Registered while it runs, as an import is: a dataclass (a flax struct, a TrainState
      # subclass) reads its module's namespace from sys.modules to resolve string annotations.
      sys.modules[module_spec.name] = module
      try:
        module_spec.loader.exec_module(module)
      except BaseException:
        sys.modules.pop(module_spec.name, None)
        raise
    else:
      module = importlib.import_module(where)
  except ImportError as e:
    raise BadInput(f'--pair {spec}: cannot import {where}: {e}') from None
  pair = getattr(module, name, None)
  if not isinstance(pair, adapter.Pair):
    raise BadInput(f'--pair {spec}: {where} has no Pair named {name!r}')
  return pair


def _resume(args) -> tuple[str, int] | None:
  if args.resume_from is None:
    if args.resume_step is not None:
      raise BadInput('--resume-step needs --resume-from')
    return None
  from parity.store import checkpoints

  try:
    manager = checkpoints.open_manager(args.resume_from, create=False, read_only=True)
  except checkpoints.CheckpointError as e:
    raise BadInput(str(e)) from None
  steps = sorted(manager.all_steps())
  manager.close()
  if not steps:
    raise BadInput(f'--resume-from {args.resume_from}: no checkpoint there')
  step = steps[-1] if args.resume_step is None else args.resume_step
  if step not in steps:
    raise BadInput(f'--resume-step {step}: not in {args.resume_from} (steps there: {steps})')
  if step + 1 >= args.steps:
    raise BadInput(f'--resume-step {step}: nothing left to train in --steps {args.steps}')
  return args.resume_from, step


def _in_worker() -> bool:
  from parity.procs import launcher
  import os

  return launcher.PROCESS_ID in os.environ


def _launch_processes(args) -> int:
  """`compare --processes N`: N copies of this command, one per simulated host."""
  import os
  import tempfile

  from parity.core import specs
  from parity.procs import launcher

  if not args.mesh:
    raise BadInput('--processes needs --mesh: the mesh spans every process\'s devices')
  try:
    total = math.prod(specs.parse_mesh_spec(args.mesh).values())
  except ValueError as e:
    raise BadInput(str(e)) from None
  if total % args.processes:
    raise BadInput(f'--mesh {args.mesh} has {total} devices: not a multiple of --processes {args.processes}')
  argv = [a for a in sys.argv[1:]]
  with tempfile.TemporaryDirectory(prefix='parity-run-') as tmp:
    if args.checkpoint_every and not args.checkpoint_dir:
      argv += ['--checkpoint-dir', os.path.join(tmp, 'checkpoints')]  # one directory, shared
    env = dict(os.environ)
    env['XLA_FLAGS'] = ' '.join(
        f for f in env.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')
    )
    print(f'parity: {args.processes} processes x {total // args.processes} CPU devices,'
          f' coordinator on {launcher.LOOPBACK}; process 0 reports', file=sys.stderr)
    try:
      launcher.launch(
          [sys.executable, '-m', 'parity', *argv], args.processes,
          timeout_s=args.timeout, env=env, log_dir=tmp, verdict_codes=(1, 2),
      )
    except launcher.LaunchError as e:
      print(f'parity: error: {e}', file=sys.stderr)
      return 3
    except launcher.Verdict as v:
      return v.code
  return 0


def out_of_memory_message(error: BaseException, args) -> str | None:
  """One line for an XLA out-of-memory error (None for any other error)."""
  import re

  text = str(error)
  if 'RESOURCE_EXHAUSTED' not in text and 'Out of memory' not in text:
    return None
  asked = re.search(r'allocate (?:memory for )?([0-9.]+ ?[KMGT]?i?B|[0-9]+ bytes)', text)
  import jax

  device = jax.devices()[0]
  where = f'{device.platform} ({getattr(device, "device_kind", device.platform)})'
  size = f' asked for {asked.group(1)}' if asked else ' ran out of memory'
  return (
      f'out of memory on {where}: preset {args.preset}, scenario {args.scenario}'
      f'{", mesh " + args.mesh if args.mesh else ", one device"}:{size}. What helps:'
      ' rematerialisation (--scenario 04_remat), a mesh over more devices (--mesh fsdp=N),'
      ' or a smaller batch (a smaller preset, e.g. --preset small)'
  )


def cmd_renames(args) -> int:
  """`parity renames --pair FILE.py:NAME`: the inferred module correspondences, as Python (the
  given ones alone where the NNX side infers none, `infer_renames=False`)."""
  from parity.core import rng
  from parity.pairs import correspond

  pair = _load_pair(args.pair)
  linen, nnx_side = pair.make_sides(None)
  infer = getattr(nnx_side, 'correspondence', None)
  if infer is None:
    raise BadInput(f'--pair {args.pair}: its NNX side ({type(nnx_side).__name__}) does not infer'
                   ' correspondences (parity.StockNnx does)')
  if getattr(nnx_side, 'infer_renames', True) is False:  # the side takes its given renames alone
    print(f'# {pair.name}: module correspondences given (infer_renames=False: nothing inferred)')
    print(correspond.Correspondence(getattr(nnx_side, 'renames', correspond.Renames())).python())
    return 0
  key = rng.first_step_key(pair.seed)
  try:
    found = infer(linen, pair.batch(0, 'train'), key)
  except correspond.CorrespondenceError as e:
    print(f'parity: {e}', file=sys.stderr)
    return 1
  if found is None:
    raise BadInput(f'--pair {args.pair}: its Linen side ({type(linen).__name__}) is not a stock'
                   ' Linen side (parity.StockLinen): nothing to trace its module calls with')
  print(f'# {pair.name}: module correspondences inferred from one traced train-mode loss per side')
  print(found.python())
  return 0


def cmd_convert_any(args) -> int:
  """`parity convert`: a declared pair's own checkpoints (parity/store/pair_convert/); without `--pair`,
  the reference decoder's pair of `--preset` and `--scenario`, through the same converter."""
  _refuse_reference_options(args)
  return cmd_convert_pair(args, _the_pair(args))


def cmd_convert_pair(args, pair) -> int:
  """`parity convert [--pair FILE.py:NAME] SRC DST --to linen|nnx [--verify]`: exit 0 converted, 1
  verification failed, 2 bad input (nothing written)."""
  from parity.core.errors import TreeMismatchError
  from parity.store import pair_convert

  if args.mesh and not args.verify:
    raise BadInput('--mesh: only with --verify (the conversion itself runs no step)')
  from parity.pairs import adapter

  mesh = _mesh(args.mesh, pair)
  try:
    return pair_convert.command_convert(args, pair, mesh)
  except (pair_convert.ConvertError, TreeMismatchError, adapter.BatchError, adapter.SideError) as e:
    raise BadInput(str(e)) from None
  except KeyboardInterrupt:
    raise BadInput('interrupted; nothing written to DST, SRC untouched') from None


def cmd_diff_checkpoints(args) -> int:
  """`parity diff-checkpoints --pair FILE.py:NAME A B`: exit 0 equal, 1 different, 2 bad input."""
  from parity.core.errors import TreeMismatchError
  from parity.store import pair_convert

  from parity.pairs import adapter

  pair = _load_pair(args.pair)
  try:
    return pair_convert.command_diff(args, pair)
  except (pair_convert.ConvertError, TreeMismatchError, adapter.BatchError, adapter.SideError) as e:
    raise BadInput(str(e)) from None


def cmd_record(args) -> int:
  """`parity record --pair FILE.py:NAME --side linen OUT`: the side's battery results as a record
  (parity/records/), made to be committed; exit 0 written, 2 bad input."""
  from parity.env import xla_env
  from parity.records import files
  from parity.records import writing

  pair = _load_pair(args.pair)
  if not xla_env.backends_started():  # the flags the battery runs under (parity/battery/plugin.py)
    flags = list(xla_env.GPU_DETERMINISTIC_FLAGS)
    if pair.meshes:
      from parity.core import specs

      flags.append(xla_env.host_device_count_flag(math.prod(specs.parse_mesh_spec(pair.meshes[0]).values())))
    xla_env.add_flags(tuple(flags))
  if args.parts:
    import dataclasses

    from parity.battery.parts import PARTS

    parts = tuple(p.strip() for p in args.parts.split(',') if p.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
      raise BadInput(f'--parts {args.parts}: unknown part(s) {unknown}; parts: {", ".join(PARTS)}')
    pair = dataclasses.replace(pair, parts=parts)
  try:
    writing.record(pair, args.out, side=args.side)
  except (ValueError, files.RecordError) as e:
    raise BadInput(str(e)) from None
  return 0


def cmd_scenarios(args) -> int:
  return reference_decoder().scenarios_command(args)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='parity', description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest='command', required=True)

  specs = sub.add_parser('specs', help='parameter (or, with --activations, activation-constraint) tables of both sides;'
                             ' exit 1 if they differ')
  specs.add_argument('--preset', default=None, help="the reference decoder's size (default: default)")
  specs.add_argument('--scenario', default=None, help='see `parity scenarios` (default: 01_baseline)')
  specs.add_argument('--mesh', default=None, help='e.g. fsdp=8 or data=2,fsdp=2,tensor=2 (with --pair,'
                     " default: the pair's first mesh)")
  specs.add_argument('--format', choices=('table', 'json'), default='table')
  specs.add_argument('--activations', action='store_true',
                     help="the activation constraints' logical names instead of the parameters'")
  specs.add_argument('--pair', default=None, metavar='FILE.py:NAME',
                     help="a declared pair's tables (a parity.Pair, e.g."
                          ' tests/test_family_production.py:production) instead of the reference'
                          " decoder's; --preset and --scenario do not apply")
  specs.set_defaults(func=cmd_specs)

  compare = sub.add_parser(
      'compare',
      help='train both sides side by side and report; exit 0 bit-identical and the same'
           ' program (memory to the byte, canonical program; --numbers-only: the numbers alone),'
           ' 1 otherwise, 2 bad input, 3 a process of --processes failed',
  )
  compare.add_argument('--preset', default=None, help='the reference decoder\'s size (default: tiny)')
  compare.add_argument('--scenario', default=None, help='see `parity scenarios` (default: 01_baseline)')
  compare.add_argument('--mesh', default=None,
                       help='e.g. fsdp=8 or data=2,fsdp=2,tensor=2 (default: one device)')
  compare.add_argument('--steps', type=int, default=10)
  compare.add_argument('--seed', type=int, default=0)
  compare.add_argument('--init', choices=('linen', 'nnx'), default=None,
                       help='which side initialises (the other receives the state; default: linen);'
                            ' not with --resume-from, where both sides restore the checkpoint')
  compare.add_argument('--checkpoint-every', type=int, default=0, metavar='N',
                       help='save both states with Orbax every N steps, timed apart (0: never)')
  compare.add_argument('--checkpoint-dir', default=None, metavar='DIR',
                       help='where --checkpoint-every saves (default: a temporary directory)')
  compare.add_argument('--json', default=None, metavar='FILE', help='everything, machine-readable')
  compare.add_argument('--markdown', default=None, metavar='FILE',
                       help='both tables as Markdown (a pull-request comment)')
  compare.add_argument('--plot', default=None, metavar='FILE.png',
                       help='loss curves, their difference and step times (matplotlib)')
  compare.add_argument('--numbers-only', action='store_true',
                       help='exit 0 when the numbers are bit-identical, even if memory or the'
                            ' program differs (both are still reported)')
  compare.add_argument('--no-program-check', action='store_true',
                       help='do not compare the two train steps\' programs (each side\'s step is'
                            ' then traced once, not twice, and not canonicalised: quicker on a'
                            ' large model); memory is still compared, and the report says'
                            ' "not compared"')
  compare.add_argument('--nondeterministic-gpu', action='store_true',
                       help='on a GPU, leave XLA free to pick nondeterministic kernels (default:'
                            ' --xla_gpu_deterministic_ops=true, needed for bitwise runs)')
  compare.add_argument('--pair', default=None, metavar='FILE.py:NAME',
                       help='compare a declared pair (a parity.pairs.adapter.Pair, e.g.'
                            ' tests/test_family_classifier.py:classifier or module:NAME) instead'
                            ' of the reference decoder; --preset and --scenario do not apply')
  compare.add_argument('--processes', type=int, default=1, metavar='N',
                       help='run as N processes on this machine (a local coordinator, gloo'
                            ' collectives), each with its share of the --mesh devices, as N pod'
                            ' hosts would; process 0 prints the report')
  compare.add_argument('--timeout', type=float, default=900.0, metavar='S',
                       help='with --processes: stop every process and fail after S seconds'
                            ' (default 900)')
  compare.add_argument('--resume-from', default=None, metavar='DIR',
                       help='both sides restore the checkpoint in DIR (one side\'s directory of'
                            ' --checkpoint-dir, e.g. DIR/linen) at --resume-step and train on to'
                            ' --steps')
  compare.add_argument('--resume-step', type=int, default=None, metavar='N',
                       help='the checkpoint step --resume-from restores (default: its latest)')
  compare.add_argument('--decode', type=int, default=0, metavar='N',
                       help='after training, both sides decode N tokens with their KV cache from one'
                            ' prompt (the reference decoder: 16 tokens of an eval batch; a pair: its'
                            ' Decode), timed side by side and compared bit for bit (0: no decoding)')
  compare.add_argument('--state-digest', action='store_true',
                       help='add final_state_sha256 (the final state\'s raw bits, gathered) to'
                            ' the JSON, to compare runs across process counts')
  compare.set_defaults(func=cmd_compare)

  from parity.store import pair_convert
  pair_convert.add_convert_parser(sub, cmd_convert_any)
  pair_convert.add_diff_parser(sub, cmd_diff_checkpoints)
  renames = sub.add_parser('renames', help="a pair's module correspondences (Linen path -> NNX path),"
                           ' inferred, printed as Python to paste and edit; exit 1 if some cannot be paired')
  renames.add_argument('--pair', required=True, metavar='FILE.py:NAME',
                       help='the pair (a parity.Pair), e.g. tests/test_family_encoder.py:encoder')
  renames.set_defaults(func=cmd_renames)
  record = sub.add_parser('record', help="one side's battery results written as a record, to prove the other"
                         ' side against once it is deleted (docs/after-linen.md)')
  record.add_argument('--pair', required=True, metavar='FILE.py:NAME', help='the pair (a parity.Pair)')
  record.add_argument('--side', default='linen', choices=('linen',), help='the side recorded (default: linen)')
  record.add_argument('--parts', default=None, metavar='PART,PART',
                      help="the parts recorded (default: the pair's, every part it has)")
  record.add_argument('out', metavar='OUT', help='the record\'s directory (replaced once the record is complete)')
  record.set_defaults(func=cmd_record)
  scenarios = sub.add_parser('scenarios', help='list the scenarios')
  scenarios.set_defaults(func=cmd_scenarios)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    if getattr(args, 'processes', 1) > 1 and not _in_worker():
      return args.func(args)  # the launcher: jax is not started here
    prepare_xla(args)
    if _in_worker():
      return _run_worker(args)
    return args.func(args)
  except BadInput as e:
    print(f'parity: error: {e}', file=sys.stderr)
    return 2


def _run_worker(args) -> int:
  """One process of `--processes N`: join the run, then the command as usual.

  Exit 0, 1 or 2 as the command decides (every process decides alike); a
  crash is 3, so the launcher can tell a verdict from a failure.
  """
  import traceback

  from parity.procs import distributed

  distributed.initialize_from_env()
  try:
    return args.func(args)
  except BadInput:
    raise
  except Exception:  # reported with its traceback, as a process failure
    traceback.print_exc()
    return 3


if __name__ == '__main__':
  # Run as `python -m parity.run.cli`, this file is `__main__`; go through the
  # imported module so `BadInput` raised by other modules is the one caught.
  from parity.run import cli as _cli

  sys.exit(_cli.main())
