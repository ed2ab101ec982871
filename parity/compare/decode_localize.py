"""The localizer on a decode: the first module call that differs, and in which model call.

A side's decode function runs once more, eagerly (`jax.disable_jit`), with
every module's `__call__` recorded as the train-mode localizer records it
(parity/compare/localize.py); a call of the model itself (the prefill's, then
one per token fed) starts a fresh record. The records are compared model
call by model call with `localize.localize`, so a module called k times in
one model call is still matched call by call (`call_key`), and the first
model call with a differing module output is named with the module.

Model call r of R maps to the decode's steps as the decode part counts them
(`Side.decode`): the last `steps - 1` model calls feed tokens 0..steps-2 and
give the logits of steps 1..steps-1; the calls before them are the prefill,
whose last gives step 0's logits.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
from flax import nnx

from parity.compare import localize
from parity.core import compat
from parity.pairs import adapter


class _PerModelCall:
  """Hands each model call (an outermost module call) a recorder of its own; records eagerly."""

  def __init__(self, call_key: Callable[[str], str], to_nnx: Callable[[str], str] | None = None):
    self.call_key = call_key
    self.to_nnx = to_nnx  # an NNX side's: a Linen module path -> NNX's (its calls named both ways)
    self.recorders: list[localize.Recorder] = []
    self.depth = 0

  def call(self, path: str, args: tuple, run: Callable[[], Any]) -> Any:
    if self.depth == 0:
      self.recorders.append(localize.Recorder(None, self.call_key))
    self.depth += 1
    try:
      return self.recorders[-1].call(path, args, run)  # a call under a trace: unrecorded
    finally:
      self.depth -= 1

  @contextlib.contextmanager
  def opened(self):
    yield  # eager: transformed bodies run as Python, their calls recorded as any other

  def probes(self) -> list[adapter.Probe]:
    return [localize.RecordedProbe(
        order=list(r.order), inputs=dict(r.inputs), outputs=localize.flat_outputs(r.outputs),
        cotangents={}, param_grads={}, unrecorded=r.unrecorded_calls(),
        nnx_names={} if self.to_nnx is None else localize.nnx_names(r.order, r.root.made_as, self.to_nnx))
        for r in self.recorders]


def linen_decode_calls(decode: Callable[[], Any]) -> list[adapter.Probe]:
  """The module calls of `decode()` (a Linen side's decode, run eagerly), one probe per model call."""
  recorder = _PerModelCall(lambda key: key)
  with jax.disable_jit(), localize.linen_intercept(recorder):
    decode()
  return recorder.probes()


def nnx_decode_calls(model: nnx.Module, decode: Callable[[nnx.Module], Any], rename: Callable[[str], str],
                     call_key: Callable[[str], str] = lambda key: key,
                     to_nnx: Callable[[str], str] = lambda path: path) -> list[adapter.Probe]:
  """The module calls of `decode(model)` (an NNX side's decode, run eagerly), named by
  `rename` (NNX path -> Linen's) and `call_key` (a repeated call's key -> Linen's), one
  probe per model call; each call's NNX name kept where it differs (`to_nnx`, `rename`'s
  inverse: the localizer names both)."""
  recorder = _PerModelCall(call_key, to_nnx)
  with jax.disable_jit(), compat.eager_sharding_off(), localize.nnx_intercept(model, recorder, rename):
    decode(model)
  return recorder.probes()


@dataclasses.dataclass
class DecodeLocalization:
  """Where a decode first differs: a module and the model call (and decode step) it ran in."""

  model_calls: tuple[int, int]  # model calls recorded (Linen, NNX)
  steps: int
  call: int | None = None  # the first model call with a difference (None: every call agrees)
  found: localize.Localization | None = None
  compared_calls: int = 0

  def step(self) -> str:
    """Model call `call` as the decode part counts steps."""
    prefill = self.model_calls[0] - (self.steps - 1)
    if self.call >= prefill:
      return f'decode step {self.call - prefill + 1} of {self.steps} (it feeds token {self.call - prefill})'
    last = ', which gives step 0\'s logits' if self.call == prefill - 1 else ''
    return f'the prefill (model call {self.call} of its {prefill}{last})'

  def lines(self) -> list[str]:
    if self.model_calls[0] != self.model_calls[1]:
      return [f'decode localizer: the sides call their models {self.model_calls[0]} (Linen) and'
              f' {self.model_calls[1]} (NNX) times while decoding; compared the first'
              f' {min(self.model_calls)}' + ('' if self.found is None else f': {self._where()}')]
    if self.found is None:
      return [f'decode localizer: all {self.model_calls[0]} model calls of the decode ({self.compared_calls}'
              ' module calls) agree bit for bit when run eagerly: the difference arises outside the'
              ' modules (sampling, the cache\'s handling between calls) or only when compiled']
    return [f'decode localizer: {self._where()}']

  def _where(self) -> str:
    found = self.found
    detail = found.details.get(found.forward_call, '')
    where = (f'inside module {found._module(found.forward)}, outside its submodules (the input of'
             f' {found._call(found.forward_call)} differs)' if found.forward_inside
             else f'at module {found._module(found.forward)}')
    if not found.forward_inside and '#' in found.forward_call:  # a repeated call: a scanned stack's layer, say
      where += f' (its call {int(found.forward_call.rsplit("#", 1)[1]) + 1} in that model call)'

    return f'first differs {where}, in model call {self.call} of {self.model_calls[0]}: {self.step()} ({detail})'

  def first(self) -> dict[str, Any] | None:
    """`{path, model_call, step}` of the first difference (None: none found)."""
    if self.found is None:
      return None
    prefill = self.model_calls[0] - (self.steps - 1)
    return {'path': self.found.forward, 'model_call': self.call,
            'step': self.call - prefill + 1 if self.call >= prefill else None}


def localize_decode(linen: list[adapter.Probe], nnx_calls: list[adapter.Probe], steps: int) -> DecodeLocalization:
  """The first model call of the decode in which a recorded module output differs, and that module."""
  result = DecodeLocalization(model_calls=(len(linen), len(nnx_calls)), steps=steps)
  for r, (a, b) in enumerate(zip(linen, nnx_calls)):
    found = localize.localize(a, b)
    result.compared_calls += found.compared_calls
    if found.forward is not None:
      result.call, result.found = r, found
      break
  return result
