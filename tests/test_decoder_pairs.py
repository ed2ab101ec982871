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


import dataclasses

from bridge import reference
from models.config import SCENARIOS
from parity import Pair

PARTS = ('structure', 'specs', 'init', 'grads', 'train', 'eval', 'checkpoints', 'resume')
# The localizer on a scanned stack (probed through its unscanned twin) and on unscanned layers.
LOCALIZED = ('01_baseline', '02_unscanned')
# Decoding with the KV cache (the pair's 16-token prompt, 32 tokens), greedy and sampled, one device and data=8.
DECODED = ('01_baseline', '02_unscanned')


def _pair(scenario: str) -> Pair:
  # The reference decoder's own declaration (bridge/reference.py, what `parity compare` runs),
  # its parts chosen for the battery: memory and program are test_program_parity.py's.
  return dataclasses.replace(
      reference.pair('tiny', scenario),
      name=f'decoder_{scenario}',
      parts=PARTS + (('localize',) if scenario in LOCALIZED else ()) + (('decode',) if scenario in DECODED else ()),
      group=scenario,
  )


for _scenario in sorted(SCENARIOS):
  globals()[f'decoder_{_scenario}'] = _pair(_scenario)
