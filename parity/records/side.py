"""`parity.recorded(DIR)`: a record standing for a deleted side in a pair.

It gives what the battery reads of a side without running it (its checkpoint layout, parameter
specs, rules, the common start's values, its train step's program and memory, its activation
constraints); whatever would run the deleted code raises `NotRecorded`, naming the member. The
live side takes from it what it took from the deleted side (module correspondences, dropout
draws: `StockNnx.adopt_recorded`)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np

from parity.records import files


class NotRecorded(RuntimeError):
  """A member of a recorded side that would run the deleted side's code."""


def _tuples(x: Any) -> Any:
  """JSON's lists as the tuples they were."""
  return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


_KEY_IMPLS = {'fry': 'threefry2x32', 'rbg': 'rbg', 'urbg': 'unsafe_rbg'}


def parse_kind(kind: str) -> tuple[tuple[int, ...], Any]:
  """`float32[4, 8]` as ((4, 8), its dtype); a typed key `key<fry>[]` as its key dtype."""
  name, _, shape = kind.partition('[')
  dims = tuple(int(d) for d in shape.rstrip(']').split(',') if d.strip())
  if name.startswith('key<') and name.endswith('>'):
    impl = _KEY_IMPLS.get(name[4:-1], name[4:-1])
    return dims, jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
  return dims, np.dtype(name)


@dataclasses.dataclass(eq=False)
class RecordedSide:
  """The deleted side, as its record keeps it (one per placement; `mesh` None: one device)."""

  record: files.Record
  mesh: jax.sharding.Mesh | None = None
  live: Any = None  # the live side beside it in the pair (`attach`): its batches are placed alike

  @property
  def name(self) -> str:
    return self.record.manifest['side']

  @property
  def rules(self):
    rules = self.record.manifest.get('rules')
    return None if rules is None else _tuples(rules)

  def attach(self, live: Any) -> None:
    self.live = live

  def adopt_into(self, live: Any) -> None:
    """Gives the live side what it took from the deleted side when the record was taken."""
    adopted = self.record.manifest.get('adopted')
    if adopted is not None and hasattr(live, 'adopt_recorded'):
      live.adopt_recorded({name: _tuples(value) for name, value in adopted.items()})  # JSON's lists as tuples

  def _refuse(self, member: str):
    raise NotRecorded(
        f'the {self.name} side is recorded ({self.record.name}): its `{member}` would run the deleted code,'
        ' which a record cannot; a part that needs it is not checked against a record')

  # What the battery reads without running the side.

  def init(self, seed: int) -> dict[str, np.ndarray]:
    """The common start the record's runs began from (the deleted side's init at the record's seed)."""
    if seed != self.record.manifest['seed']:
      raise files.RecordError(f'record {self.record.name}: taken with seed {self.record.manifest["seed"]},'
                              f' asked for seed {seed}: declare the pair with seed={self.record.manifest["seed"]}'
                              ' or take the record again')
    if self.record.manifest.get('abstract'):  # recorded from shapes alone: the state's shapes
      return {path: jax.ShapeDtypeStruct(*parse_kind(kind)) for path, kind, _ in
              self.record.table('structure')['checkpoint layout']}
    # On a device, as the deleted side's init left it (committed arrays: a host array would lower
    # the live side's step with other sharding annotations); the live side places it from there.
    return jax.device_put(self.record.start(), jax.devices()[0])

  def to_checkpoint(self, state: Mapping[str, Any]) -> dict[str, Any]:
    return dict(state)

  def from_checkpoint(self, flat: Mapping[str, Any]) -> dict[str, Any]:
    return dict(flat)

  def place_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    if self.live is None:
      self._refuse('place_batch')
    return self.live.place_batch(batch)

  def abstract_checkpoint(self) -> dict[str, jax.ShapeDtypeStruct]:
    out = {}
    for path, kind, _ in self.record.table('structure')['checkpoint layout']:
      shape, dtype = parse_kind(kind)
      out[path] = jax.ShapeDtypeStruct(shape, dtype)
    return out

  def param_specs(self) -> dict[str, tuple]:
    import json

    return {path: tuple(tuple(e) if isinstance(e, list) else e for e in json.loads(spec))
            for path, _, spec in self.record.table('specs')['logical']}

  def recorded_activations(self, mesh_sizes: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """The train step's activation constraints as the specs part reads them (logical names)."""
    if mesh_sizes is not None:
      self._refuse('train_step_function (activation constraints on a mesh)')
    return [{**row, 'context': _tuples(row['context'])} for row in self.record.activations()]

  def recorded_step(self) -> Any:
    """The train step as the program and memory parts read a compiled one (parity.run.compiling.CompiledStep)."""
    from parity.run import compiling

    program = self.record.manifest['program']
    memory = dict(program['memory'])

    class _Recorded(compiling.CompiledStep):
      def memory(self, device):
        del device
        return memory

      def compared_memory(self, device):
        del device
        return memory

    return _Recorded(None, '', 0.0, 0.0, self.record.program(), list(program['argument_names']),
                     allowed_applied=bool(program['allowed_applied']))

  def recorded_layouts(self) -> dict[str, Any]:
    """The deleted side's own checkpoint layouts by format, as recorded (none: not recorded)."""
    if not self.record.manifest.get('layouts'):
      return {}
    return self.record.layouts()

  # What would run the deleted side.

  def train_step(self, *args, **kwargs):
    self._refuse('train_step')

  def eval_step(self, *args, **kwargs):
    self._refuse('eval_step')

  def value_and_grads(self, *args, **kwargs):
    self._refuse('value_and_grads')

  def train_step_function(self):
    self._refuse('train_step_function')

  def lower_train_step(self, *args, **kwargs):
    self._refuse('lower_train_step')

  def comparison_state(self, state):
    self._refuse('comparison_state')

  def argument_names(self, *args, **kwargs):
    self._refuse('argument_names')


def recorded(directory: str | os.PathLike) -> 'Recorded':
  """A record standing for the deleted Linen side: `make_sides` returns `(record.side(mesh), nnx side)`,
  or `parity.model_pair(linen=parity.recorded(DIR), ...)` (docs/after-linen.md). A relative
  `directory` is read from the directory of the file that calls this (the pair's file), as a
  test's data files are, wherever pytest runs from."""
  import sys

  directory = os.fspath(directory)
  if not os.path.isabs(directory):
    caller = sys._getframe(1).f_code.co_filename  # pylint: disable=protected-access
    if os.path.isfile(caller):
      directory = os.path.join(os.path.dirname(os.path.abspath(caller)), directory)
  return Recorded(os.path.abspath(directory))


@dataclasses.dataclass(frozen=True)
class Recorded:
  """A record by its directory, read on first use (a pair file imports before the record is read)."""

  directory: str

  def side(self, mesh: jax.sharding.Mesh | None = None) -> RecordedSide:
    return RecordedSide(files.read(self.directory), mesh)


def is_recorded(side: Any) -> bool:
  return isinstance(side, RecordedSide)
