"""Benchmark (not a test): `parity convert --pair` on the reference decoder's `default` preset.

  python benchmarks/convert_pair_default.py SCRATCH_DIR [--layers N] [--zarr3] [--keep] [--no-diff]

1. Writes SCRATCH_DIR/src as the Linen side's own save code writes it:
   `ocp.StandardCheckpointer().save(path, train_state)` of the reference
   decoder's Linen TrainState (`default` preset: 1,104,218,112 parameters,
   AdamW mu and nu, step; about 13.25 GB), with `_METADATA` in Orbax's order
   and placeholders, chunked as an fsdp=8 run saves it (one chunk per device
   shard), random values, zarr (Orbax's StandardCheckpointer default with
   this orbax) or zarr3 (`--zarr3`). It is written streaming, one chunk at a
   time: the state is never in memory whole.
2. Converts it to the NNX side's `nnx.state((model, optimizer))` layout in a
   child process, through the command as a user runs it:
   `parity convert --pair benchmarks/convert_pair_default.py:decoder_default
   SRC DST --to nnx` (the pair below). Reports the command's wall time and
   the child's peak resident memory (VmHWM: the whole process, interpreter,
   jax and the kit included), absolute and above its resident memory just
   before the command (jax and the kit imported), against a quarter of the
   checkpoint's size.
3. Compares SRC with the conversion in another child, through the pair:
   `parity diff-checkpoints --pair ... SRC DST` (exit 0: equal), measured
   the same way (`--no-diff`: skipped).
4. Copies SCRATCH_DIR/src with `cp -r` and `sync` (the converter fsyncs its
   output too), before the conversion: the time a conversion is compared with.

Needs about 3x the checkpoint size free on the scratch disk (40 GB for 16
layers); `--layers` shrinks the model for a quick trial. Goals: peak resident
memory of the converting process under a quarter of the checkpoint's size
(the issue's bound; exit 1 otherwise), convert time at most 2x the copy time
and peak memory growth at most 2 GiB (about one box plus one largest array,
never the model). `parity convert` without `--pair` runs this same converter
through the reference decoder's pair of `--preset` and `--scenario`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

import parity  # noqa: E402

LAYERS_ENV = 'PARITY_BENCH_LAYERS'  # the child's pair takes the parent's --layers
HANDLER = 'orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler'


def _configs():
  from models.config import get_configs, replace

  model_cfg, train_cfg = get_configs('default')
  layers = os.environ.get(LAYERS_ENV)
  if layers:
    model_cfg = replace(model_cfg, num_layers=int(layers))
  return model_cfg, train_cfg


def _sides(mesh):
  from bridge.sides import make_sides

  return make_sides(*_configs(), mesh)


def _batch(step, split='train'):
  from models import data

  return data.make_batch(*_configs(), step=step, split=split)


# The reference decoder's `default` preset as a declared pair (its sides are bridge/sides.py's).
decoder_default = parity.Pair('decoder_default', _sides, _batch)

_CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {repo!r})
    import jax  # noqa: F401  (imported before the idle measure, as the command imports it)
    from parity.run import cli
    from parity.store import pair_convert  # noqa: F401

    def status_kib(field):
      with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ':'))

    argv = json.loads(sys.argv[1])
    idle = status_kib('VmRSS')
    start = time.perf_counter()
    code = cli.main(argv)
    seconds = time.perf_counter() - start
    # VmHWM: this process's own peak (ru_maxrss can carry the parent's peak over a vfork and exec).
    print(json.dumps({{'code': code, 'seconds': seconds, 'idle_kib': idle, 'peak_kib': status_kib('VmHWM')}}))
""")


def _measured(argv: list[str]) -> dict | None:
  """`cli.main(argv)` in a child process: its exit code, wall seconds, idle and peak resident KiB."""
  start = time.perf_counter()
  child = subprocess.run([sys.executable, '-c', _CHILD.format(repo=REPO), json.dumps(argv)],
                         capture_output=True, text=True, env=dict(os.environ))
  lines = child.stdout.strip().splitlines()
  if child.returncode != 0 or not lines:
    print(child.stdout[-3000:], child.stderr[-3000:], sep='\n')
    return None
  result = json.loads(lines[-1])
  result.update(output=lines[:-1], process_seconds=time.perf_counter() - start)
  return result


def _memory(result: dict, bound: float) -> str:
  """Peak resident memory, absolute and above idle, against `bound` bytes."""
  peak, idle = result['peak_kib'] * 1024, result['idle_kib'] * 1024
  verdict = 'under' if peak < bound else 'NOT under'
  return (f'peak RSS {peak / 2**30:.2f} GiB ({peak / 1e9:.2f} GB), {verdict} a quarter of the checkpoint'
          f' ({bound / 1e9:.2f} GB); {(peak - idle) / 2**30:.2f} GiB above idle ({idle / 2**30:.2f} GiB)')


def _values(path: str, shape, dtype, gen: np.random.Generator) -> np.ndarray:
  """Plausible values (random, so about as incompressible as real ones)."""
  if np.issubdtype(dtype, np.integer):
    return np.full(shape, 1000, dtype)
  x = gen.standard_normal(shape, dtype=np.float32)
  if '/nu/' in path:
    x = np.abs(x) * np.float32(1e-6)
  elif '/mu/' in path:
    x *= np.float32(1e-3)
  else:
    x *= np.float32(0.02)
  return x.astype(dtype, copy=False)


def write_source(directory: str, zarr3: bool) -> int:
  """The Linen side's TrainState as StandardCheckpointer saves it from an fsdp=8 run; returns its bytes."""
  from parity.core import specs
  from parity.store import pair_convert
  from parity.store.pair_convert import streaming

  linen, _ = _sides(specs.make_mesh('fsdp=8'))
  layout = pair_convert.side_layout(linen, 'linen', 'linen')
  shardings = linen.checkpoint_shardings()
  gen = np.random.default_rng(0)
  writer = pair_convert._Writer(directory, zarr3=zarr3)
  jobs, total = [], 0
  for leaf in layout.leaves:
    shape, dtype = leaf.shape, leaf.dtype
    sharding = shardings.get(leaf.checkpoint)
    chunk = tuple(sharding.shard_shape(shape)) if sharding is not None else shape
    boxes = ((box, _values(leaf.disk, tuple(b.stop - b.start for b in box), dtype, gen))
             for box in streaming._boxes(shape, chunk))
    writer.write(leaf.disk, shape, dtype, chunk, boxes, {'value_type': 'jax.Array', 'skip_deserialize': False})
    jobs.append(pair_convert._Job(leaf, None))
    total += math.prod(shape) * dtype.itemsize
    print(f'  wrote {leaf.disk} {dtype.name}{list(shape)}', flush=True)
  writer.finish_as(layout, {})
  pair_convert._write_array_metadatas(directory, jobs, writer)
  streaming.write_step_metadata(directory, [], base={
      'item_handlers': HANDLER, 'metrics': {}, 'performance_metrics': {}, 'init_timestamp_nsecs': time.time_ns()})
  return total


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(p, f)) for p, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('scratch')
  parser.add_argument('--layers', type=int, default=None, help='fewer layers, for a quick trial')
  parser.add_argument('--zarr3', action='store_true', help='write the source as zarr3 (default: zarr, as'
                      " Orbax's StandardCheckpointer writes here)")
  parser.add_argument('--keep', action='store_true', help='keep the checkpoints')
  parser.add_argument('--no-diff', action='store_true', help='skip diff-checkpoints of SRC and the conversion')
  args = parser.parse_args(argv)
  if args.layers:
    os.environ[LAYERS_ENV] = str(args.layers)

  os.makedirs(args.scratch, exist_ok=True)
  src, dst, copy = (os.path.join(args.scratch, n) for n in ('src', 'converted', 'copy'))
  for path in (src, dst, copy):
    if os.path.exists(path):
      parser.error(f'{path} exists; remove it or pick another scratch directory')
  layers = args.layers or 16
  need = 3 * (1.57e9 + 11.7e9 * layers / 16)  # embeddings and logits, then the layers
  free = shutil.disk_usage(args.scratch).free
  if free < need:
    parser.error(f'{args.scratch}: {free / 1e9:.1f} GB free, about {need / 1e9:.1f} GB needed')

  print(f"writing the default preset's Linen checkpoint ({layers} layers, {'zarr3' if args.zarr3 else 'zarr'})"
        f' to {src} ...', flush=True)
  start = time.perf_counter()
  array_bytes = write_source(src, args.zarr3)
  os.sync()
  disk_bytes = _du(src)
  print(f'  {array_bytes / 1e9:.2f} GB of arrays, {disk_bytes / 1e9:.2f} GB on disk,'
        f' written in {time.perf_counter() - start:.1f} s')
  # The bound: a quarter of the checkpoint's size (the smaller of its arrays and its files).
  bound = min(array_bytes, disk_bytes) / 4

  print('plain copy (cp -r, sync) ...', flush=True)
  start = time.perf_counter()
  subprocess.run(['cp', '-r', src, copy], check=True)
  os.sync()
  copy_seconds = time.perf_counter() - start
  shutil.rmtree(copy)
  os.sync()

  spec = os.path.abspath(__file__) + ':decoder_default'
  print(f'converting to the NNX layout: parity convert --pair {spec} ...', flush=True)
  converted = _measured(['convert', '--pair', spec, src, dst, '--to', 'nnx'])
  if converted is None:
    return 1
  print('\n'.join(converted['output']))
  diffed = None
  if not args.no_diff and converted['code'] == 0:
    os.sync()
    print(f'comparing SRC with the conversion: parity diff-checkpoints --pair {spec} ...', flush=True)
    diffed = _measured(['diff-checkpoints', '--pair', spec, src, dst])
    if diffed is None:
      return 1
    print('\n'.join(diffed['output'][-3:]))
  print()
  print(f'checkpoint:        {array_bytes / 1e9:.2f} GB of arrays ({disk_bytes / 1e9:.2f} GB on disk);'
        f' a quarter: {bound / 1e9:.2f} GB')
  print(f'convert --pair:    exit {converted["code"]}, {converted["seconds"]:.1f} s wall'
        f' ({converted["process_seconds"]:.1f} s with the process\'s start and imports)')
  print(f'  memory:          {_memory(converted, bound)}')
  if diffed is not None:
    print(f'diff-checkpoints:  exit {diffed["code"]}, {diffed["seconds"]:.1f} s wall'
          f' ({diffed["process_seconds"]:.1f} s with the process\'s start and imports)')
    print(f'  memory:          {_memory(diffed, bound)}')
  print(f'plain copy:        {copy_seconds:.1f} s (cp -r + sync)')
  print(f'convert / copy:    {converted["seconds"] / copy_seconds:.2f}  (goal <= 2)')
  if not args.keep:
    shutil.rmtree(src)
    shutil.rmtree(dst, ignore_errors=True)
  ok = converted['code'] == 0 and converted['peak_kib'] * 1024 < bound
  ok = ok and (diffed is None or (diffed['code'] == 0 and diffed['peak_kib'] * 1024 < bound))
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
