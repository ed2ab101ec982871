"""Benchmark (not a test): memory and program parity of a big preset, nothing allocated.

  python benchmarks/memory_default.py [--preset default] [--scenario 04_remat] [--mesh fsdp=8]

Lowers and compiles both sides' train steps on abstract inputs (shapes and
shardings only: no parameter is ever created), then prints XLA's memory
analysis of each (per device), the memory verdict and the canonical program
verdict, as `parity compare` would report them. On a CPU the numbers are
XLA:CPU's buffer assignment; an accelerator's differ, but the comparison
(equal to the byte or not) is what this checks.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from parity.env import xla_env  # noqa: E402  (imports no jax)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--preset', default='default')
  parser.add_argument('--scenario', default='04_remat')
  parser.add_argument('--mesh', default=None, help='e.g. fsdp=8 (CPU devices are made for it)')
  args = parser.parse_args()
  if args.mesh:
    from parity.core.specs import parse_mesh_spec  # noqa: E402  (imports jax; no backend started)
    count = math.prod(parse_mesh_spec(args.mesh).values())
    xla_env.add_flags([xla_env.host_device_count_flag(count)])

  import jax

  from parity.core import specs
  from models.config import get_configs
  from parity.run import compiling
  from parity.run import verdicts
  from bridge.sides import abstract_step_inputs, make_sides

  model_cfg, train_cfg = get_configs(args.preset, args.scenario)
  mesh = specs.make_mesh(args.mesh) if args.mesh else None
  batch, key = abstract_step_inputs(model_cfg, train_cfg)
  device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
  print(f'preset {args.preset} ({model_cfg.param_count():,} parameters), scenario'
        f' {args.scenario}, mesh {args.mesh or "none (one device)"}', flush=True)
  compiled = {}
  for side in make_sides(model_cfg, train_cfg, mesh):
    state = side.template
    if mesh is not None:
      state = jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, side.state_shardings
      )
    start = time.perf_counter()
    compiled[side.name] = compiling.compile_step(side, state, batch, key)
    memory = compiled[side.name].memory(device)
    print(f'{side.name:5}: compiled in {time.perf_counter() - start:.1f} s; ' + ', '.join(
        f'{field} {memory[field]:,}' for field in verdicts.MEMORY_FIELDS), flush=True)
  linen_memory, nnx_memory = (compiled[n].memory(device) for n in ('linen', 'nnx'))
  drift = verdicts.memory_drift(linen_memory, nnx_memory)
  print('memory: ' + ('equal to the byte' if not drift else 'differs (NNX ' + ', '.join(drift) + ')'))
  diff = compiling.program_diff_of(compiled['linen'], compiled['nnx'])
  print(diff.summary())
  return 0 if not drift and diff.identical else 1


if __name__ == '__main__':
  sys.exit(main())
