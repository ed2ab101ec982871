"""The localizer's probes: each side's loss traced with its module calls recorded (Linen and NNX)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
from flax import nnx

from parity.compare import bridged
from parity.compare import scopes
from parity.compare.localize.recording import ROOT, Recorder, _Bodies, _float_tree, _split_call, _zeros_like, flat_outputs
from parity.core import compat
from parity.core import paths
from parity.pairs import adapter


def _on_call(recorder: Recorder) -> bridged.OnCall:
  """A module call recorded by `recorder`; a Linen module's `init` is not (it is not the
  computation compared: a decode's cache is made by one, as flax does)."""

  def on_call(path, module, args, run):
    if isinstance(module, nn.Module) and module.is_initializing():
      return run()
    return recorder.call(path, args, run)

  return on_call


@contextlib.contextmanager
def linen_intercept(recorder: Recorder):
  """Records each module call (`__call__` and public methods; through any wrapper between the
  frameworks: parity/compare/bridged.py), except inside a lifted transform's body (`nn.scan`,
  `nn.remat`, ...) that the recorder has not opened: its values are the body's tracers, which
  cannot leave it (their paths go to `unrecorded`)."""
  with bridged.linen_calls(_on_call(recorder)), recorder.opened():
    yield


# Set by `layers_opened`: the probes record the module calls inside scanned and
# rematerialised bodies (`Recorder`), each layer of a stack by its index.
_OPENED = [False]


@contextlib.contextmanager
def layers_opened():
  """While active, `linen_probe` and `nnx_probe` record the module calls inside `jax.lax.scan`
  and `jax.checkpoint` bodies (Linen `nn.scan`, `nn.remat`; NNX `nnx.scan`, `nnx.remat`, and
  `jax.lax.scan` over `nnx.split` state), a stack's layers named by their index
  (`layers/1/mlp`); `localize_step` probes so."""
  before = _OPENED[0]
  _OPENED[0] = True
  try:
    yield
  finally:
    _OPENED[0] = before


def linen_probe(loss: Callable, has_aux: bool, state: Any, batch: Any, dropout_key: Any) -> adapter.Probe:
  """The probe of a stock-TrainState side: loss(params, state, batch, key)."""
  bodies = _Bodies() if _OPENED[0] else None

  def traced(params, probes, state, batch, dropout_key):
    recorder = Recorder(probes, bodies=bodies)
    recorder.name_params(params, lambda p: 'params/' + p)
    with linen_intercept(recorder):
      value = loss(params, state, batch, dropout_key)
    value = value[0] if has_aux else value
    seen[:] = [recorder]
    return value, (recorder.outputs, recorder.inputs)

  seen: list[Recorder] = []
  probe = _probe(
      traced, seen, state.params, (state, batch, dropout_key),
      lambda p: {'params/' + k: g for k, g in paths.flatten(p).items()},
  )
  return probe


@contextlib.contextmanager
def nnx_intercept(model: nnx.Module, recorder: Recorder, rename: Callable[[str], str]):
  """Each module class's `__call__` and public methods wrapped (restored on exit); outermost
  call per instance recorded (through any wrapper between the frameworks), except inside a
  transform's body (`nnx.remat`, `nnx.scan`, ...) that the recorder has not opened, whose
  module copies (named by their originals' tags, parity/compare/scopes.py) compute the
  body's tracers: their paths go to `unrecorded`, as on the Linen side."""
  scopes.tag_paths(model, rename)
  with bridged.nnx_calls(_on_call(recorder), rename), recorder.opened():
    yield


def nnx_probe(
    loss: Callable, graphdef: Any, state: Any, batch: Any, dropout_key: Any, renames,
    prefix: str = 'params/', to_linen: Callable = lambda path, x: x,
    call_key: Callable[[str], str] = lambda key: key,
) -> adapter.Probe:
  """The probe of a stock NNX side: loss(model, batch, key) on the merged (model, optimizer).

  `call_key` maps a recorded call's key (its Linen path by `renames`, `#n`
  for the n-th repeat of one module's call) to Linen's, where one NNX module
  called twice is two Linen modules.
  """
  # The (model, optimizer) state split so that only the model's parameters
  # are differentiated (the optimizer holds no nnx.Param).
  params, rest = nnx.split_state(state, nnx.Param, ...)
  bodies = _Bodies() if _OPENED[0] else None
  name = lambda k: prefix + renames.to_linen(k[2:])  # noqa: E731

  def traced(params, probes, rest, batch, dropout_key):
    # Fresh Variables of this trace (merge reuses the state's own, which
    # belong to the caller's trace and refuse the in-place batch-stat update).
    params, rest = jax.tree.map(lambda x: x, (params, rest))
    with compat.eager_sharding_off():
      model, _ = nnx.merge(graphdef, params, rest)
    recorder = Recorder(probes, call_key, bodies)
    recorder.name_params(params, name)
    with nnx_intercept(model, recorder, renames.to_linen):
      value = loss(model, batch, dropout_key)
    seen[:] = [recorder]
    return value, (recorder.outputs, recorder.inputs)

  seen: list[Recorder] = []
  probe = _probe(
      traced, seen, params, (rest, batch, dropout_key),
      lambda p: {name(k): to_linen(k[2:], g) for k, g in paths.flatten(p).items()},
  )
  to_nnx = getattr(renames, 'to_nnx', lambda path: path)
  return dataclasses.replace(probe, unrecorded=tuple(call_key(u) for u in probe.unrecorded),
                             nnx_names=nnx_names(probe.order, seen[0].root.made_as, to_nnx))


def nnx_names(keys, made_as: dict[str, str], to_nnx: Callable[[str], str]) -> dict[str, str]:
  """Of the NNX calls recorded under Linen's `keys`, each one's NNX name where it is not the
  Linen one: the call as it was made (`made_as`), its module path renamed back to NNX's
  (`to_nnx`, the pair's renames: Linen's `LayerNorm_1` is NNX's `ln2`)."""
  out = {}
  for key in keys:
    module, suffix = _split_call(made_as.get(key, key))
    own = (module if module == ROOT else _layer_renamed(module, to_nnx)) + suffix
    if own != key:
      out[key] = own
  return out


def _layer_renamed(module: str, to_nnx: Callable[[str], str]) -> str:
  """`to_nnx(module)` for a module inside a scanned body, `<stack>/<i>/<rest>` (the layer, or the
  step, i of the loop): the renames are of paths without the index, which goes back after the
  stack's NNX path."""
  parts = module.split('/')
  at = next((i for i, part in enumerate(parts) if i and part.isdigit()), None)
  if at is None:
    return to_nnx(module)
  stack, plain = to_nnx('/'.join(parts[:at])), to_nnx(module)
  whole = to_nnx('/'.join(parts[:at] + parts[at + 1:]))
  # A rename of the index itself (a Linen module named '0') stands as the renames give it.
  if at + 1 < len(parts) and whole.startswith(stack + '/') and plain.startswith(f'{stack}/{parts[at]}/'):
    return f'{stack}/{parts[at]}{whole[len(stack):]}'
  return plain


def _probe(traced: Callable, seen: list[Recorder], params: Any, args: tuple,
           name_grads: Callable) -> adapter.Probe:
  """Outputs, output cotangents and parameter gradients of one traced loss.

  `traced(params, probes, *args) -> (loss, outputs)` leaves its recorder in `seen`
  each time it is traced (the module calls in execution order, the calls it could not record).
  """
  _, (shapes, _) = jax.eval_shape(lambda p, a: traced(p, None, *a), params, args)
  shapes = {k: _float_tree(v) for k, v in shapes.items()}

  def loss_and_grads_probe(params, args):  # its program's name in `--parity-programs`
    grad = jax.value_and_grad(traced, argnums=(0, 1), has_aux=True)
    (loss, (outputs, inputs)), (param_grads, cotangents) = grad(params, _zeros_like(shapes), *args)
    return loss, outputs, inputs, cotangents, param_grads

  loss, outputs, inputs, cotangents, param_grads = jax.jit(loss_and_grads_probe)(params, args)
  recorder = seen[0]
  return RecordedProbe(
      loss=loss,
      order=list(recorder.order),
      inputs=dict(inputs),
      outputs=flat_outputs(outputs),
      cotangents=flat_outputs(cotangents),
      param_grads=name_grads(param_grads),
      unrecorded=recorder.unrecorded_calls(),
      events=list(recorder.root.events),
      callers=dict(recorder.root.callers),
      stacked=dict(recorder.stacked),
  )


@dataclasses.dataclass(frozen=True)
class RecordedProbe(adapter.Probe):
  """A probe as the recorder makes it: `inputs`, each call's arrays by argument name;
  `events`, ('call' | 'return', key) in execution order (a call's arguments are compared
  as it starts); `callers`, each call's caller (the module whose code made its arguments);
  `stacked`, each opened stack's path -> the parameters its scan slices by layer on axis 0
  (their gradients are compared layer by layer in the backward pass; none: a loop, which
  slices none); `nnx_names`, an NNX
  probe's calls by their NNX names, keyed by Linen's, where the two differ (`nnx_probe`)."""

  # The loss the gradients are of: the grads part reads it and `param_grads` (one program per
  # side serves the grads part and the localizer).
  loss: Any = None
  events: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  callers: dict[str, str] = dataclasses.field(default_factory=dict)
  stacked: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  # An NNX probe's: each call's NNX name (module path and call) where Linen names it otherwise.
  nnx_names: dict[str, str] = dataclasses.field(default_factory=dict)
