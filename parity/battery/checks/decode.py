"""The decode part: decoding with a KV cache, tokens, logits and cache bit for bit."""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from parity.battery.checks.shared import RefusedDeclaration, _battery_frames_hidden, _runs, compare
from parity.core import bitwise
from parity.core import rng
from parity.pairs import adapter


def _decode_localized(pair: adapter.Pair, sides, states, prompt, steps: int, key, temperature) -> list[str]:
  """The decode localizer's finding, as lines for a failure message (parity.compare.decode_localize)."""
  from parity.compare import decode_localize

  if not all(callable(getattr(s, 'decode_calls', None)) for s in sides):
    return ['decode localizer: not run (a side gives no `decode_calls`)']
  try:  # the decode's own failure stays the message's first line, whatever the localizer meets
    calls = [side.decode_calls(state, prompt, steps, key, temperature) for side, state in zip(sides, states)]
    return decode_localize.localize_decode(*calls, steps).lines()
  except Exception as e:  # noqa: BLE001
    return [f'decode localizer: could not run eagerly ({type(e).__name__}: {e})']


def check_decode(pair: adapter.Pair, placement: str) -> list[str]:
  """Decoding with a KV cache from one state (the Linen init, carried to NNX), on one device
  or a mesh: tokens, every step's logits and the final cache, bit for bit, at each temperature."""
  __tracebackhide__ = _battery_frames_hidden
  from parity.battery.parts import ONE_DEVICE

  spec = pair.decode
  if spec is None:
    raise AssertionError(f'{pair.name}: no decoding declared (Pair(decode=parity.Decode(...)))')
  runs = _runs(pair)
  mesh_spec = None if placement == ONE_DEVICE else placement
  linen, nnx_side = runs.sides(mesh_spec)
  missing = [s.name for s in (linen, nnx_side) if not callable(getattr(s, 'decode', None))]
  if missing:
    raise AssertionError(f'{pair.name}: the pair declares decoding, but its {", ".join(missing)} side(s)'
                         ' give no `decode` (StockLinen/StockNnx: decode_fn=)')
  flat = runs.start('linen', mesh_spec)
  states = (linen.from_checkpoint(flat), nnx_side.from_checkpoint(flat))
  prompt = linen.place_batch({'prompt': spec.prompt(pair.batch(0, 'eval'))})['prompt']
  key = rng.decode_key(pair.seed)
  lines = []
  for temperature in spec.temperatures:
    out = [side.decode(state, prompt, spec.steps, key, temperature) for side, state in zip((linen, nnx_side), states)]
    for what in ('tokens', 'logits'):
      a, b = (np.asarray(jax.device_get(o[what])) for o in out)
      if a.shape == b.shape and a.ndim >= 2 and a.dtype == b.dtype:
        same = [bitwise.bitwise_equal(a[:, i], b[:, i]) for i in range(a.shape[1])]
        if not all(same):
          first = same.index(False)
          try:
            compare(pair, 'decode', {what: a}, {what: b},
                    f'decoded {what} ({"greedy" if temperature == 0 else f"temperature {temperature}"},'
                    f' {placement}; first differing decode step: {first} of {spec.steps})')
          except RefusedDeclaration:
            raise
          except AssertionError as e:
            located = _decode_localized(pair, (linen, nnx_side), states, prompt, spec.steps, key, temperature)
            raise AssertionError('\n  '.join([str(e)] + located)) from None
    found = compare(pair, 'decode', {'tokens': out[0]['tokens'], 'logits': out[0]['logits'], **out[0]['cache']},
                    {'tokens': out[1]['tokens'], 'logits': out[1]['logits'], **out[1]['cache']},
                    f'decoded tokens, logits and final cache ({"greedy" if temperature == 0 else f"temperature {temperature}"}, {placement})')
    lines += found
    lines.append(f'{"greedy" if temperature == 0 else f"temperature {temperature}"}, {placement}: {spec.steps}'
                 f' tokens, their logits and {len(out[0]["cache"])} cache arrays bit for bit')
    if mesh_spec is not None:
      lines.append(_cache_placed_alike(pair, out[0]['cache'], out[1]['cache'], placement))
  return lines


def _cache_placed_alike(pair: adapter.Pair, linen: Mapping[str, Any], nnx_cache: Mapping[str, Any],
                        placement: str) -> str:
  """The final caches' arrays placed alike on the mesh (their annotations resolve to the same
  shardings); the caches' paths and values are compared already."""
  __tracebackhide__ = _battery_frames_hidden
  placed = {p: (x.sharding, nnx_cache[p].sharding) for p, x in linen.items()
            if p in nnx_cache and hasattr(x, 'sharding') and hasattr(nnx_cache[p], 'sharding')}
  shown = lambda s: tuple(s.spec) if hasattr(s, 'spec') else s  # noqa: E731
  bad = [f'{p}: Linen {shown(a)}, NNX {shown(b)}' for p, (a, b) in sorted(placed.items())
         if not a.is_equivalent_to(b, np.ndim(linen[p]))]
  assert not bad, (f'{pair.name}: the decoded caches are placed otherwise on {placement}'
                   f' ({len(bad)} of {len(placed)} arrays):\n  ' + '\n  '.join(bad))
  return f'{placement}: the {len(placed)} cache arrays placed alike (their shardings equivalent)'
