"""The reference decoder declared through the plugin, one pair per scenario.

The plugin's battery (parity/battery/checks/) runs on the decoder's sides
(bridge/sides.py, which implement the adapter's `Side`): structure, logical
specs, loss and gradients, training from each side's init, eval, Orbax round
trips in four directions and resume across sides; the localizer on a scanned
and an unscanned scenario. What is specific to the decoder stays in its own
modules: the seed parameter table and goldens (test_specs_default.py,
test_scenarios.py), the 3-axis meshes and their rules (test_sharding.py),
memory and program parity with the step-counter allowlist
(test_program_parity.py), fp8 (test_fp8.py), gradient accumulation bounds,
resharding restores and the converter.

Each pair's tests join its scenario's xdist group, so they reuse the sides
(and compiled steps) the scenario's other tests build in that worker.
"""
from __future__ import annotations

import functools

from parity import Decode, Pair
from models import data
from models.config import SCENARIOS, get_configs
from bridge import decode as bridge_decode
from bridge.sides import make_sides
from parity.core import specs

STEPS = 10  # as the runner's side-by-side runs (tests/runs.py)
PARTS = ('structure', 'specs', 'init', 'grads', 'train', 'eval', 'checkpoints', 'resume')
# The localizer on a scanned stack (probed through its unscanned twin) and on unscanned layers.
LOCALIZED = ('01_baseline', '02_unscanned')
# Decoding with the KV cache (a 16-token prompt, 32 tokens), greedy and sampled, one device and data=8.
DECODED = ('01_baseline', '02_unscanned')
DECODE_PROMPT, DECODE_STEPS = 16, 32


def _sides(cfgs, mesh):
  # The decoder's rules and its KV cache's (the decode part places the cache by them).
  return make_sides(*cfgs, mesh, specs.DEFAULT_RULES + bridge_decode.CACHE_RULES)


def _batch(cfgs, step, split='train'):
  return data.make_batch(*cfgs, step=step, split=split)


def _pair(scenario: str) -> Pair:
  cfgs = get_configs('tiny', scenario)
  return Pair(
      f'decoder_{scenario}',
      functools.partial(_sides, cfgs),
      functools.partial(_batch, cfgs),
      steps=STEPS,
      parts=PARTS + (('localize',) if scenario in LOCALIZED else ()) + (('decode',) if scenario in DECODED else ()),
      group=scenario,
      decode=Decode(prompt=lambda batch: batch['inputs'][:, :DECODE_PROMPT], steps=DECODE_STEPS),
  )


for _scenario in sorted(SCENARIOS):
  globals()[f'decoder_{_scenario}'] = _pair(_scenario)
