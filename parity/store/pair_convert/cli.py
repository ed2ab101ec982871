"""`parity convert --pair` and `parity diff-checkpoints`: their options and commands."""
from __future__ import annotations

from typing import Any

from parity.store.pair_convert.comparing import compare_checkpoints
from parity.store.pair_convert.converting import convert_checkpoint
from parity.store.pair_convert.layouts import FORMATS, OWN_FORMATS


def add_pair_options(convert_parser) -> None:
  """`parity convert --pair`'s options, beside the reference converter's."""
  convert_parser.add_argument('--pair', default=None, metavar='FILE.py:NAME',
                              help="convert a declared pair's own checkpoint (Orbax StandardCheckpointer or"
                                   ' CheckpointManager, as its save code writes it) to the other side\'s,'
                                   ' through its correspondences')
  convert_parser.add_argument('--verify', action='store_true',
                              help='with --pair: restore SRC and DST with the sides\' own restore code, take'
                                   ' one train step on each and require every leaf bit for bit (exit 1'
                                   ' otherwise, DST not written)')
  convert_parser.add_argument('--item', default=None, help='with --pair: the train state\'s item of a'
                              ' CheckpointManager step (default: the one that matches the pair)')
  convert_parser.add_argument('--format', dest='target_format', default=None, choices=FORMATS + OWN_FORMATS,
                              help='with --pair: the tree DST holds (default: the target side\'s own'
                                   ' layout where the pair declares it, Pair(saves=...), else linen, or nnx'
                                   ' for nnx.state((model, optimizer)); nnx-pure: nnx.to_pure_dict of it)')
  convert_parser.add_argument('--mesh', default=None, help="with --pair --verify: the steps' mesh (default:"
                              ' one device)')


def command_convert(args, pair: Any, mesh: Any) -> int:
  """`parity convert --pair`: exit 0 converted (and verified), 1 verification failed."""
  result = convert_checkpoint(pair, args.src, args.dst, args.to, step=args.step, item=args.item,
                              target_format=args.target_format, verify=args.verify, mesh=mesh)
  what = f'{result.source_format} -> {result.target_format}' + (
      f' (step {result.step})' if result.step is not None else '')
  notes = []
  if result.dropped:
    notes.append(f'left out {len(result.dropped)} leaves only NNX keeps ({", ".join(result.dropped[:4])}'
                 f'{", ..." if len(result.dropped) > 4 else ""})')
  if result.initialised:
    notes.append(f'{len(result.initialised)} leaves only NNX keeps as create(0) makes them'
                 f' ({", ".join(result.initialised[:4])}{", ..." if len(result.initialised) > 4 else ""})')
  if result.verified is False:
    print(f'parity: verification failed: {len(result.differences)} leaves differ after restoring SRC and'
          f' the conversion with each side\'s own code and one train step; nothing written to DST:')
    for line in result.differences:
      print(f'  {line}')
    return 1
  verified = '; verified: one train step on each side, bit for bit' if result.verified else ''
  print(f'converted pair {pair.name} {what}: {result.arrays} arrays, {result.bytes / 2**20:.1f} MiB,'
        f' {result.seconds:.2f} s -> {result.dst}{verified}' + ''.join(f'\n  {n}' for n in notes))
  return 0


def command_diff(args, pair: Any) -> int:
  """`parity diff-checkpoints`: exit 0 equal, 1 different."""
  diff = compare_checkpoints(pair, args.a, args.b, step_a=args.step_a, step_b=args.step_b, item=args.item)
  print(diff.report(limit=args.max_lines))
  return 0 if diff.equal else 1


def add_diff_parser(subparsers, func) -> None:
  """`parity diff-checkpoints`'s arguments."""
  diff = subparsers.add_parser(
      'diff-checkpoints', help="compare two of a pair's checkpoints (either side's) leaf by leaf through its"
                               ' correspondences; exit 0 equal, 1 different, 2 bad input')
  diff.add_argument('a', metavar='A', help='a checkpoint (StandardCheckpointer or CheckpointManager directory)')
  diff.add_argument('b', metavar='B', help='the other')
  diff.add_argument('--pair', required=True, metavar='FILE.py:NAME', help='the pair (a parity.Pair)')
  diff.add_argument('--step-a', type=int, default=None, help="A's step (CheckpointManager; default: latest)")
  diff.add_argument('--step-b', type=int, default=None, help="B's step (CheckpointManager; default: latest)")
  diff.add_argument('--item', default=None, help='the train state\'s item (default: the one that matches)')
  diff.add_argument('--max-lines', type=int, default=200, help='differences printed at most (default 200)')
  diff.set_defaults(func=func)
