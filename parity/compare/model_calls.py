"""Module calls recorded eagerly, one record per model call: what the decode and eval localizers compare.

A side's function (its decode, its eval step) runs once more, eagerly
(`jax.disable_jit`), with every module's `__call__` recorded as the
train-mode localizer records it (parity/compare/localize/); a call of the
model itself (an outermost module call) starts a fresh record. Records are
compared model call by model call with `localize.localize`, so a module
called k times in one model call is still matched call by call.
"""
from __future__ import annotations

import contextlib
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
    """Rematerialised bodies run as they are: in a forward pass run eagerly, `jax.checkpoint`
    changes no value, but would trace its body, whose calls could not be recorded. (Scans
    run eagerly under `jax.disable_jit`, their calls recorded as any other.)"""
    checkpoint, remat = jax.checkpoint, jax.remat
    try:
      jax.checkpoint = jax.remat = _through
      yield
    finally:
      jax.checkpoint, jax.remat = checkpoint, remat

  def probes(self) -> list[adapter.Probe]:
    return [localize.RecordedProbe(
        order=list(r.order), inputs=dict(r.inputs), outputs=localize.flat_outputs(r.outputs),
        cotangents={}, param_grads={}, unrecorded=r.unrecorded_calls(),
        # Each call's arguments compared as it starts, as the train localizer compares them: an
        # argument the caller made otherwise (a mask) blames the caller, not the callee's insides.
        events=list(r.root.events), callers=dict(r.root.callers),
        nnx_names={} if self.to_nnx is None else localize.nnx_names(r.order, r.root.made_as, self.to_nnx))
        for r in self.recorders]


def _through(fun: Callable, **_: Any) -> Callable:
  """`jax.checkpoint` for an eager forward pass: `fun` itself."""
  return fun


def linen_model_calls(run: Callable[[], Any]) -> list[adapter.Probe]:
  """The module calls of `run()` (a Linen side's decode or eval step, run eagerly), one probe per
  model call."""
  recorder = _PerModelCall(lambda key: key)
  with jax.disable_jit(), localize.linen_intercept(recorder):
    run()
  return recorder.probes()


def nnx_model_calls(model: nnx.Module, run: Callable[[nnx.Module], Any], rename: Callable[[str], str],
                    call_key: Callable[[str], str] = lambda key: key,
                    to_nnx: Callable[[str], str] = lambda path: path) -> list[adapter.Probe]:
  """The module calls of `run(model)` (an NNX side's decode or eval step, run eagerly), named by
  `rename` (NNX path -> Linen's) and `call_key` (a repeated call's key -> Linen's), one
  probe per model call; each call's NNX name kept where it differs (`to_nnx`, `rename`'s
  inverse: the localizer names both)."""
  recorder = _PerModelCall(call_key, to_nnx)
  with jax.disable_jit(), compat.eager_sharding_off(), localize.nnx_intercept(model, recorder, rename):
    run(model)
  return recorder.probes()


def first_difference(linen: list[adapter.Probe], nnx_calls: list[adapter.Probe]
                     ) -> tuple[int | None, localize.Localization | None, int]:
  """(the first model call in which a recorded module output differs, the localizer's finding
  there, the module calls compared up to it); (None, None, n) where every call agrees."""
  compared = 0
  for r, (a, b) in enumerate(zip(linen, nnx_calls)):
    found = localize.localize(a, b)
    compared += found.compared_calls
    if found.forward is not None:
      return r, found, compared
  return None, None, compared


def where(found: localize.Localization) -> str:
  """Where `found`'s forward difference is, in words: at a module (which of its calls, where
  repeated), or inside one, outside its submodules."""
  if found.forward_inside:
    return (f'inside module {found._module(found.forward)}, outside its submodules (the input of'
            f' {found._call(found.forward_call)} differs)')
  place = f'at module {found._module(found.forward)}'
  if '#' in found.forward_call:  # a repeated call: a scanned stack's layer, say
    place += f' (its call {int(found.forward_call.rsplit("#", 1)[1]) + 1} in that model call)'
  return place
