"""Benchmark (not a test): `parity convert` on a `default`-preset checkpoint.

  python benchmarks/convert_default.py SCRATCH_DIR [--layout scan_axis0] [--layers N] [--keep]

1. Writes SCRATCH_DIR/src: the Linen train state of the `default` preset
   (1,104,218,112 parameters, AdamW mu and nu, step; about 13 GB) and a
   dropout key, chunked as an fsdp=8 run saves it (one zarr3 chunk per
   device shard), with random values. It is written streaming, one chunk at
   a time, by the converter's own writer: the state is never in memory whole.
2. Converts it to the NNX layout `--layout` in a child process, and reports
   the wall time of `convert()` and the child's peak resident memory above
   its resident memory just before converting.
3. Copies SCRATCH_DIR/src with `cp -r` and `sync` (the converter fsyncs its
   output too): the time a conversion is compared with.

Needs about 3x the checkpoint size free on the scratch disk; `--layers`
shrinks the model for a quick trial. Goals (issue 5): convert time at most
2x the copy time; peak memory growth at most 2 GiB.
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

STEP = 1000

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    sys.path.insert(0, {repo!r})
    from parity.store import convert

    def rss_kib():
      with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))

    src, dst, layout = sys.argv[1:4]
    idle = rss_kib()
    start = time.perf_counter()
    result = convert.convert(src, dst, to='nnx', layout=layout)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({{'seconds': seconds, 'idle_kib': idle, 'peak_kib': peak,
                      'arrays': result.arrays, 'bytes': result.bytes}}))
""")


def _values(path: str, shape, dtype, gen: np.random.Generator) -> np.ndarray:
  """Plausible values (random, so about as incompressible as real ones)."""
  if np.issubdtype(dtype, np.integer):
    return np.full(shape, STEP, dtype)
  x = gen.standard_normal(shape, dtype=np.float32)
  if '/nu/' in path:
    x = np.abs(x) * np.float32(1e-6)
  elif '/mu/' in path:
    x *= np.float32(1e-3)
  else:
    x *= np.float32(0.02)
  return x.astype(dtype, copy=False)


def write_source(directory: str, num_layers: int | None) -> int:
  """Writes the default preset's state as an fsdp=8 save would; returns its array bytes."""
  from parity.core import specs
  from models.config import get_configs, replace
  from parity.store import checkpoints as ck
  from parity.store import convert
  from bridge.sides import make_sides

  model_cfg, train_cfg = get_configs('default')
  if num_layers is not None:
    model_cfg = replace(model_cfg, num_layers=num_layers)
  linen, _ = make_sides(model_cfg, train_cfg, specs.make_mesh('fsdp=8'))
  abstract = linen.abstract_checkpoint()  # eval_shape: nothing allocated
  gen = np.random.default_rng(0)
  step_dir = os.path.join(directory, str(STEP))
  writer = convert.ItemWriter(os.path.join(step_dir, ck.ITEMS))
  total = 0
  for path, leaf in abstract.items():
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    chunk = tuple(leaf.sharding.shard_shape(shape))
    boxes = (
        (box, _values(path, tuple(b.stop - b.start for b in box), dtype, gen))
        for box in convert._boxes(shape, chunk)
    )
    writer.write(path, shape, dtype, chunk, boxes)
    total += math.prod(shape) * dtype.itemsize
    print(f'  wrote {path} {dtype.name}{list(shape)}', flush=True)
  writer.finish()
  rng_writer = convert.ItemWriter(os.path.join(step_dir, ck.RNG))
  key = np.array([0, 0x0D0], np.uint32)
  rng_writer.write(ck.DROPOUT_BASE, (2,), key.dtype, (2,), iter([((slice(0, 2),), key)]))
  rng_writer.finish()
  convert.write_step_metadata(step_dir, [ck.ITEMS, ck.RNG])
  return total


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(p, f)) for p, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('scratch')
  parser.add_argument('--layout', default='scan_axis0', help="'scan_axis0' (default), 'unscanned' or 'same'")
  parser.add_argument('--layers', type=int, default=None, help='fewer layers, for a quick trial')
  parser.add_argument('--keep', action='store_true', help='keep the checkpoints')
  args = parser.parse_args(argv)

  os.makedirs(args.scratch, exist_ok=True)
  src, dst, copy = (os.path.join(args.scratch, n) for n in ('src', 'converted', 'copy'))
  for path in (src, dst, copy):
    if os.path.exists(path):
      parser.error(f'{path} exists; remove it or pick another scratch directory')
  layers = args.layers or 16
  need = 3 * 13.3e9 * layers / 16
  free = shutil.disk_usage(args.scratch).free
  if free < need:
    parser.error(f'{args.scratch}: {free / 1e9:.1f} GB free, about {need / 1e9:.1f} GB needed')

  print(f'writing the default-preset checkpoint ({layers} layers) to {src} ...', flush=True)
  start = time.perf_counter()
  array_bytes = write_source(src, args.layers)
  os.sync()
  print(f'  {array_bytes / 1e9:.2f} GB of arrays, {_du(src) / 1e9:.2f} GB on disk,'
        f' written in {time.perf_counter() - start:.1f} s')

  print('plain copy (cp -r, sync) ...', flush=True)
  start = time.perf_counter()
  subprocess.run(['cp', '-r', src, copy], check=True)
  os.sync()
  copy_seconds = time.perf_counter() - start
  shutil.rmtree(copy)
  os.sync()

  print(f'converting to the NNX layout {args.layout!r} ...', flush=True)
  child = subprocess.run(
      [sys.executable, '-c', _CHILD.format(repo=REPO), src, dst, args.layout],
      check=True, capture_output=True, text=True,
  )
  result = json.loads(child.stdout.strip().splitlines()[-1])
  growth_gib = (result['peak_kib'] - result['idle_kib']) / 2**20
  print()
  print(f'checkpoint:        {result["arrays"]} arrays, {result["bytes"] / 1e9:.2f} GB'
        f' ({_du(src) / 1e9:.2f} GB on disk)')
  print(f'convert:           {result["seconds"]:.1f} s wall ({args.layout})')
  print(f'peak RSS growth:   {growth_gib:.2f} GiB (idle {result["idle_kib"] / 2**20:.2f} GiB,'
        f' peak {result["peak_kib"] / 2**20:.2f} GiB)')
  print(f'plain copy:        {copy_seconds:.1f} s (cp -r + sync)')
  print(f'convert / copy:    {result["seconds"] / copy_seconds:.2f}  (goal <= 2)')
  if not args.keep:
    shutil.rmtree(src)
    shutil.rmtree(dst)
  return 0


if __name__ == '__main__':
  sys.exit(main())
