"""`parity convert` and `parity diff-checkpoints`: their options and commands."""
from __future__ import annotations

import sys
from typing import Any

from parity.store.pair_convert.comparing import compare_checkpoints
from parity.store.pair_convert.converting import convert_checkpoint
from parity.store.pair_convert.layouts import FORMATS, OWN_FORMATS
from parity.store.pair_convert.streaming import tty_progress


def add_convert_parser(subparsers, func) -> Any:
  """`parity convert`'s arguments: one converter, for a declared pair (`--pair`) or the reference decoder's."""
  convert_parser = subparsers.add_parser(
      'convert', help="convert a pair's checkpoint between its Linen and NNX sides' own layouts (streaming;"
                      " without --pair, the reference decoder's pair)",
      description="Converts one side's checkpoint, as its own save code writes it, into the tree the other"
                  " side's own restore code reads, through the pair's correspondences, box by box.",
  )
  convert_parser.add_argument('src', metavar='SRC', help='Orbax checkpoint (StandardCheckpointer or'
                              ' CheckpointManager directory)')
  convert_parser.add_argument('dst', metavar='DST', help='new checkpoint directory (must not exist or be empty,'
                              ' unless --overwrite)')
  convert_parser.add_argument('--to', required=True, choices=('linen', 'nnx'))
  convert_parser.add_argument('--step', type=int, default=None, help='a CheckpointManager SRC\'s step'
                              ' (default: the latest)')
  convert_parser.add_argument('--overwrite', action='store_true', help='replace a non-empty DST (the old one'
                              ' renamed aside, the conversion into its place, then the old one removed)')
  convert_parser.add_argument('--pair', default=None, metavar='FILE.py:NAME',
                              help="the declared pair whose checkpoint this is (a parity.Pair); default: the"
                                   " reference decoder's (--preset, --scenario)")
  convert_parser.add_argument('--preset', default=None,
                              help="without --pair: the reference decoder's size (default: tiny)")
  convert_parser.add_argument('--scenario', default=None,
                              help='without --pair: the reference decoder\'s scenario (default: 01_baseline)')
  convert_parser.add_argument('--verify', action='store_true',
                              help='restore SRC and DST with the sides\' own restore code, take one train step'
                                   ' on each and require every leaf bit for bit (exit 1 otherwise, DST not'
                                   ' written); both sides\' models must fit the devices')
  convert_parser.add_argument('--item', default=None, help='the train state\'s item of a CheckpointManager'
                              ' step (default: the one that matches the pair)')
  convert_parser.add_argument('--format', dest='target_format', default=None, choices=FORMATS + OWN_FORMATS,
                              help='the tree DST holds (default: the target side\'s own layout where the pair'
                                   ' declares it, Pair(saves=...), else linen, or nnx for nnx.state((model,'
                                   ' optimizer)); nnx-pure: nnx.to_pure_dict of it)')
  convert_parser.add_argument('--mesh', default=None, help="with --verify: the steps' mesh (default: one device)")
  convert_parser.set_defaults(func=func)
  return convert_parser


def command_convert(args, pair: Any, mesh: Any) -> int:
  """`parity convert`: exit 0 converted (and verified), 1 verification failed; progress on a terminal."""
  progress = tty_progress(sys.stderr) if sys.stderr.isatty() else None
  result = convert_checkpoint(pair, args.src, args.dst, args.to, step=args.step, item=args.item,
                              target_format=args.target_format, verify=args.verify, mesh=mesh,
                              overwrite=args.overwrite, progress=progress)
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
