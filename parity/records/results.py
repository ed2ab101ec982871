"""What a record keeps of each part, computed alike from the recorded side (as it is recorded) and
from the live side (as it is replayed): entries `(key, dtype[shape], value)` in the order a
failure reads them, so that the first entry that differs names the step and the leaf.

Every entry is computed through the battery's shared runs (parity.battery.checks.shared._Runs)
and the side's own functions; nothing here re-implements a step."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from parity.core import paths
from parity.core import rng
from parity.procs import distributed
from parity.records import digests

Entry = tuple[str, str, str]  # (key, dtype[shape], bits in hex or digest)


def _entries(prefix: str, flat: Any) -> Iterator[Entry]:
  for path, x in sorted(paths.flatten(flat).items()):
    yield f'{prefix}{path}', digests.kind(x), digests.value(x)


def grads(runs: Any, side_name: str) -> list[Entry]:
  """The loss and every parameter's gradient at the common start (step 0's batch and key), from
  the side's own `value_and_grads`."""
  side = runs.side(side_name)
  value, grad = side.value_and_grads(side.from_checkpoint(runs.start('linen')), runs.batch(0), runs.step_key(0))
  return [*_entries('loss/', {'value': value}), *_entries('grad ', grad)]


def train(runs: Any, side_name: str, init_side: str) -> list[Entry]:
  """`pair.steps` train steps from `init_side`'s init: that start, then each step's metrics, then
  the final state (checkpoint layout)."""
  metrics, final, _ = runs.trajectory(side_name, init_side)
  out = [] if init_side == 'linen' else list(_entries('start ', runs.start(init_side)))
  for step, m in enumerate(metrics):
    out += _entries(f'step {step} ', m)
  return out + list(_entries('final ', final))


def evaluation(runs: Any, side_name: str) -> list[Entry]:
  """Eval metrics and eval-mode outputs from the state the side's training (from the common start)
  ends in."""
  side = runs.side(side_name)
  _, final, _ = runs.trajectory(side_name, 'linen')
  state, batch = side.from_checkpoint(final), runs.batch(0, 'eval')
  both = getattr(side, 'eval_and_outputs', lambda *a: None)(state, batch)
  metrics, outputs = both if both is not None else (
      side.eval_step(state, batch), getattr(side, 'eval_outputs', lambda *a: None)(state, batch))
  return [*_entries('metric ', dict(metrics)), *([] if outputs is None else _entries('outputs', {'': outputs}))]


def decode(runs: Any, side_name: str, placement: str) -> list[Entry]:
  """Decoding from the common start at each temperature: each step's tokens and logits, then the
  final cache."""
  from parity.battery.parts import ONE_DEVICE

  pair = runs.pair
  mesh_spec = None if placement == ONE_DEVICE else placement
  side = runs.side(side_name, mesh_spec)
  state = side.from_checkpoint(runs.start('linen', mesh_spec))
  prompt = runs.sides(mesh_spec)[0].place_batch({'prompt': pair.decode.prompt(pair.batch(0, 'eval'))})['prompt']
  out: list[Entry] = []
  for temperature in pair.decode.temperatures:
    got = side.decode(state, prompt, pair.decode.steps, rng.decode_key(pair.seed), temperature)
    where = f'temperature {temperature} '
    for step in range(pair.decode.steps):
      for what in ('tokens', 'logits'):
        x = np.asarray(distributed.host_arrays({'x': got[what]})['x'])
        out += _entries(f'{where}step {step} ', {what: x[:, step]})
    out += _entries(f'{where}cache ', dict(got['cache']))
  return out


def mesh(runs: Any, side_name: str, mesh_spec: str) -> list[Entry]:
  """`pair.steps` train steps on the mesh from the common start: where each leaf of the final state
  is placed (first, as the mesh part checks it: a leaf placed otherwise is the cause of numbers
  that differ), each step's metrics, the final state."""
  metrics, final, _ = runs.trajectory(side_name, 'linen', mesh_spec)
  out: list[Entry] = []
  for path, x in sorted(final.items()):
    spec = getattr(getattr(x, 'sharding', None), 'spec', None)
    out.append((f'placed {path}', digests.kind(x), 'replicated' if spec is None else str(tuple(spec))))
  for step, m in enumerate(metrics):
    out += _entries(f'step {step} ', m)
  return out + list(_entries('final ', final))


def init(runs: Any, side_name: str) -> list[Entry]:
  """The side's own init (seed `pair.seed`) per leaf, as the init part compares it: a leaf random
  in its floats by its count, mean and standard deviation (float64 bits), any other by its bits."""
  flat = distributed.host_arrays(runs.start(side_name))
  out = []
  for path, x in sorted(flat.items()):
    stats = random_stats(x)
    value = digests.value(x) if stats is None else 'random n={} mean={} std={}'.format(
        stats[0], float(stats[1]).hex(), float(stats[2]).hex())
    out.append((f'init {path}', digests.kind(x), value))
  return out


def random_stats(x: Any) -> tuple[int, float, float] | None:
  """(elements, mean, std) of a float leaf whose elements are not all equal (what the init part
  compares in distribution); None for any other leaf (compared bit for bit)."""
  from parity.battery.checks import init as init_part

  if not init_part.is_random(np.asarray(x)):
    return None
  v = np.asarray(x).astype(np.float64).ravel()
  return v.size, float(v.mean()), float(v.std())


def parse_stats(value: str) -> tuple[int, float, float] | None:
  """The statistics an init entry keeps (None: a leaf kept by its bits)."""
  if not value.startswith('random '):
    return None
  fields = dict(item.split('=', 1) for item in value.split()[1:])
  return int(fields['n']), float.fromhex(fields['mean']), float.fromhex(fields['std'])


def physical(runs: Any, side_name: str, mesh_spec: str) -> list[Entry]:
  """Where the side places each leaf of its state on the mesh (its target shardings), before anything runs."""
  side = runs.side(side_name, mesh_spec)
  out = []
  for path, x in sorted(side.abstract_checkpoint().items()):
    spec = getattr(getattr(x, 'sharding', None), 'spec', None)
    out.append((path, digests.kind(x), 'replicated' if spec is None else str(tuple(spec))))
  return out
