"""The divergence localizer: which module first computes something different.

Each side's train-mode loss is traced once with every module's `__call__`
intercepted (Linen: `nn.intercept_methods`; NNX: each module class's
`__call__`, for the duration of the trace; other methods are not recorded). A zero probe is added to every
module's output, so one `value_and_grad` gives, per module call, its
forward output, the cotangent arriving at that output, and every
parameter's gradient. `localize` then compares both sides bitwise:

- forward: the first module call (in execution order) whose output differs;
- backward: a module whose output cotangent is equal on both sides but
  whose parameters' gradients differ computes its own backward pass
  differently; the innermost such module is named (of several at one depth,
  the one the backward pass runs first).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import tracers

from parity.core import paths
from parity.pairs import adapter
from parity.core import bitwise
from parity.compare import scopes
from parity.core import compat

ROOT = '(model)'
_LAYER = re.compile(r'(^|/)layers_(\d+)(/|$)')


def _float_tree(y: Any) -> Any:
  return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None, y)


class _Recorder:
  """Names each module call and adds its probe; collects outputs during one trace."""

  def __init__(self, probes: dict[str, Any] | None, call_key: Callable[[str], str] = lambda key: key):
    self.probes = probes
    self.call_key = call_key  # the key of a call (`path`, `path#n` for its n-th repeat) on the other side
    self.outputs: dict[str, Any] = {}
    self.inputs: dict[str, Any] = {}  # each call's first argument, when it is a float array
    self.order: list[str] = []
    self._calls: dict[str, int] = {}

  def record(self, path: str, y: Any, args: tuple = ()) -> Any:
    path = path or ROOT
    n = self._calls.get(path, 0)
    self._calls[path] = n + 1
    key = self.call_key(path if n == 0 else f'{path}#{n}')
    self.order.append(key)
    if args and isinstance(args[0], jax.Array) and jnp.issubdtype(args[0].dtype, jnp.inexact):
      self.inputs[key] = args[0]
    if self.probes is not None and key in self.probes:
      y = jax.tree.map(lambda a, p: a if p is None else a + p.astype(a.dtype), y, self.probes[key],
                       is_leaf=lambda x: x is None)
    self.outputs[key] = y
    return y


def _zeros_like(shapes: dict[str, Any]) -> dict[str, Any]:
  return {
      k: jax.tree.map(lambda s: None if s is None else jnp.zeros(s.shape, s.dtype), v,
                      is_leaf=lambda x: x is None)
      for k, v in shapes.items()
  }


def _flat_outputs(tree: dict[str, Any]) -> dict[str, Any]:
  out = {}
  for key, y in tree.items():
    for sub, leaf in paths.items(y):
      if leaf is not None:
        out[key if not sub else f'{key}:{sub}'] = leaf
  return out


# ---------------------------------------------------------------------------
# Linen
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _linen_intercept(recorder: _Recorder, unrecorded: list[str]):
  """Records each module's `__call__`, except inside a lifted transform's body (`nn.scan`,
  `nn.remat`, ...): its values are the body's tracers, which cannot leave it (their paths
  go to `unrecorded`; the transformed module's own call, outside, is recorded)."""
  outer = tracers.current_trace()

  def interceptor(next_fun, args, kwargs, context):
    y = next_fun(*args, **kwargs)
    if context.method_name != '__call__':
      return y
    path = '/'.join(context.module.path)
    if tracers.current_trace() != outer:
      if path not in unrecorded:
        unrecorded.append(path)
      return y
    return recorder.record(path, y, args)

  with nn.intercept_methods(interceptor):
    yield


def linen_probe(loss: Callable, has_aux: bool, state: Any, batch: Any, dropout_key: Any) -> adapter.Probe:
  """The probe of a stock-TrainState side: loss(params, state, batch, key)."""

  def traced(params, probes, state, batch, dropout_key):
    recorder = _Recorder(probes)
    unrecorded.clear()
    with _linen_intercept(recorder, unrecorded):
      value = loss(params, state, batch, dropout_key)
    value = value[0] if has_aux else value
    order[:] = recorder.order
    return value, (recorder.outputs, recorder.inputs)

  order: list[str] = []
  unrecorded: list[str] = []
  probe = _probe(
      traced, order, state.params, (state, batch, dropout_key),
      lambda p: {'params/' + k: g for k, g in paths.flatten(p).items()},
  )
  return dataclasses.replace(probe, unrecorded=tuple(unrecorded))


# ---------------------------------------------------------------------------
# NNX
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _nnx_intercept(model: nnx.Module, recorder: _Recorder, rename: Callable[[str], str],
                   unrecorded: list[str]):
  """Each module class's `__call__` wrapped (restored on exit); outermost call per instance
  recorded, except inside a transform's body (`nnx.remat`, `nnx.scan`, ...), whose module
  copies (named by their originals' tags, parity/compare/scopes.py) compute the body's tracers:
  their paths go to `unrecorded`, as on the Linen side."""
  scopes.tag_paths(model, rename)
  outer = tracers.current_trace()
  active: set[int] = set()

  def wrap(original):
    def __call__(self, *args, **kwargs):
      outermost = id(self) not in active
      active.add(id(self))
      try:
        y = original(self, *args, **kwargs)
      finally:
        if outermost:
          active.discard(id(self))
      path = scopes.tagged_path(self)
      if not outermost or path is None:
        return y
      path = path or ROOT
      if tracers.current_trace() != outer:
        if path not in unrecorded:
          unrecorded.append(path)
        return y
      return recorder.record(path, y, args)

    return __call__

  with scopes.patched_module_calls(model, wrap):
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

  def traced(params, probes, rest, batch, dropout_key):
    # Fresh Variables of this trace (merge reuses the state's own, which
    # belong to the caller's trace and refuse the in-place batch-stat update).
    params, rest = jax.tree.map(lambda x: x, (params, rest))
    with compat.eager_sharding_off():
      model, _ = nnx.merge(graphdef, params, rest)
    recorder = _Recorder(probes, call_key)
    unrecorded.clear()
    with _nnx_intercept(model, recorder, renames.to_linen, unrecorded):
      value = loss(model, batch, dropout_key)
    order[:] = recorder.order
    return value, (recorder.outputs, recorder.inputs)

  order: list[str] = []
  unrecorded: list[str] = []
  probe = _probe(
      traced, order, params, (rest, batch, dropout_key),
      lambda p: {
          prefix + renames.to_linen(k[2:]): to_linen(k[2:], g) for k, g in paths.flatten(p).items()
      },
  )
  return dataclasses.replace(probe, unrecorded=tuple(call_key(u) for u in unrecorded))


# ---------------------------------------------------------------------------


def _probe(traced: Callable, order: list[str], params: Any, args: tuple, name_grads: Callable) -> adapter.Probe:
  """Outputs, output cotangents and parameter gradients of one traced loss.

  `traced(params, probes, *args) -> (loss, outputs)` fills `order` with the
  module calls in execution order each time it is traced.
  """
  _, (shapes, _) = jax.eval_shape(lambda p, a: traced(p, None, *a), params, args)
  shapes = {k: _float_tree(v) for k, v in shapes.items()}

  def run(params, args):
    grad = jax.value_and_grad(traced, argnums=(0, 1), has_aux=True)
    (_, (outputs, inputs)), (param_grads, cotangents) = grad(params, _zeros_like(shapes), *args)
    return outputs, inputs, cotangents, param_grads

  outputs, inputs, cotangents, param_grads = jax.jit(run)(params, args)
  return adapter.Probe(
      order=list(order),
      inputs=dict(inputs),
      outputs=_flat_outputs(outputs),
      cotangents=_flat_outputs(cotangents),
      param_grads=name_grads(param_grads),
  )


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Localization:
  forward: str | None  # the module whose forward computation first differs
  forward_call: str | None  # the first module call whose output differs
  forward_inside: bool  # True: `forward` differs between its submodules' calls, not in one of them
  forward_ulp: int | None  # max ULP of the first differing value (the call's input when inside); None: see _max_ulp
  backward: list[tuple[str, list[str]]]  # (module, its parameters whose gradients differ)
  only_linen: list[str]
  only_nnx: list[str]
  details: dict[str, str]  # path -> bitwise detail of the first differing values
  backward_ulp: dict[str, int | None] = dataclasses.field(default_factory=dict)  # module -> max ULP (None: see _max_ulp)
  compared_calls: int = 0  # module calls found on both sides (their outputs compared)
  compared_grads: int = 0  # parameter gradients found on both sides
  only_linen_grads: list[str] = dataclasses.field(default_factory=list)
  only_nnx_grads: list[str] = dataclasses.field(default_factory=list)
  # The first place the module calls found on both sides come in another order:
  # (index among them, Linen's call there, NNX's call there); None: the same order.
  order_difference: tuple[int, str, str] | None = None
  unrecorded: tuple[str, ...] = ()  # modules called inside a transformed body, either side (adapter.Probe)
  # With `forward_inside`: the outermost unrecorded calls inside `forward`, where the
  # difference may have arisen as well as in its own code.
  forward_unrecorded: tuple[str, ...] = ()

  def first(self, step: int | None = None) -> dict[str, Any] | None:
    """The first divergent module: `{step, path, layer, pass, max_ulp}` (None: none found).

    A layer of a stack (`.../layers_<i>/...`, as the unscanned twin of a
    scanned stack names it) is reported as the stack's path with its index.
    """
    if self.forward is not None:
      module, pass_name, ulp = self.forward, 'forward', self.forward_ulp
    elif self.backward:
      module = self.backward[0][0]
      pass_name, ulp = 'backward', self.backward_ulp[module]
    else:
      return None
    m = _LAYER.search(module)
    layer = None if m is None else int(m.group(2))
    path = module if m is None else module[:m.start()] + m.group(1) + 'layers' + m.group(3) + module[m.end():]
    return {'step': step, 'path': path.rstrip('/'), 'layer': layer, 'pass': pass_name, 'max_ulp': ulp}

  @property
  def clean(self) -> bool:
    return self.forward is None and not self.backward

  def lines(self) -> list[str]:
    out = []
    if self.forward is not None and self.forward_inside and self.forward_unrecorded:
      out.append(
          f'forward pass: inside module {self.forward}: the input of {self.forward_call} differs'
          f' while every earlier recorded call agrees ({self.details[self.forward_call]}); it arose'
          f' in a call not recorded there, {_shown(self.forward_unrecorded)} (inside a transformed'
          f' body), or in {self.forward}\'s own code between its submodules'
      )
    elif self.forward is not None and self.forward_inside:
      out.append(
          f'forward pass: inside module {self.forward}, outside its submodules: the input of'
          f' {self.forward_call} differs while every earlier call agrees'
          f' ({self.details[self.forward_call]})'
      )
    elif self.forward is not None:
      out.append(f'forward pass: first differs at module {self.forward} ({self.details[self.forward_call]})')
    else:
      out.append('forward pass: every module output bitwise equal')
    for module, params in self.backward:
      shown = ', '.join(f'{p} ({self.details[p]})' for p in params)
      out.append(
          f'backward pass: inside module {module}: output cotangent bitwise equal,'
          f' gradients differ: {shown}'
      )
    if not self.backward:
      out.append('backward pass: every parameter gradient bitwise equal'
                 if self.forward is None else 'backward pass: not localized (the forward differs)')
    if self.order_difference is not None:
      i, a, b = self.order_difference
      out.append(f'module calls in another order: call {i} of those on both sides is {a} in Linen,'
                 f' {b} in NNX (a rename rule that maps an NNX module to another Linen path reads so)')
    if self.unrecorded:
      out.append(f'not recorded: module calls inside a transformed body (Linen nn.scan, nn.remat;'
                 f' NNX nnx.scan, nnx.remat, ...), whose values cannot leave it:'
                 f' {_shown(self.unrecorded)}; a difference there shows in the input of the first'
                 ' recorded call after them, and in their parameters\' gradients')
    if self.only_linen or self.only_nnx:
      out.append(f'unmatched module calls: linen {self.only_linen}, nnx {self.only_nnx}'
                 ' (add rename rules to compare them)')
    if self.only_linen_grads or self.only_nnx_grads:
      out.append(f'unmatched parameter gradients: linen {self.only_linen_grads},'
                 f' nnx {self.only_nnx_grads} (add rename rules to compare them)')
    return out

  @property
  def unmatched(self) -> list[str]:
    """What the localizer could not compare: calls or gradients on one side only, or nothing at all."""
    out = []
    if self.only_linen or self.only_nnx:
      out.append(f'module calls on one side only: linen {self.only_linen}, nnx {self.only_nnx}')
    if self.only_linen_grads or self.only_nnx_grads:
      out.append(f'parameter gradients on one side only: linen {self.only_linen_grads},'
                 f' nnx {self.only_nnx_grads}')
    if not self.compared_calls:
      out.append('no module call found on both sides')
    if not self.compared_grads:
      out.append('no parameter gradient found on both sides')
    return out


def _shown(names, most: int = 5) -> str:
  return ', '.join(names[:most]) + (f' and {len(names) - most} more' if len(names) > most else '')


def _outermost_inside(module: str, calls) -> tuple[str, ...]:
  """Of `calls` (module paths), those inside `module` that are not inside another of them."""
  inside = [c for c in calls if module == ROOT or c.startswith(module + '/')]
  return tuple(c for c in inside if not any(c.startswith(o + '/') for o in inside))


def _module_of(key: str) -> str:
  return key.split(':', 1)[0].split('#', 1)[0]


def _depth(module: str) -> int:
  return 0 if module == ROOT else module.count('/') + 1


def _under(param: str, module: str) -> bool:
  p = param[len('params/'):]
  return module == ROOT or p.startswith(module + '/')


def localize_step(
    linen: adapter.Side, nnx_side: adapter.Side, linen_state: dict[str, Any], batch: Any, key: Any
) -> Localization:
  """Both sides probed from one state (the checkpoint layout) on one step's placed batch and key.

  The runner and the battery both localize a divergent step this way, from
  the Linen side's state before it.
  """
  probes = [side.probe(side.from_checkpoint(linen_state), batch, key) for side in (linen, nnx_side)]
  return localize(*probes)


def localize(linen: adapter.Probe, nnx_probe: adapter.Probe) -> Localization:
  details: dict[str, str] = {}

  def differs(a, b, key) -> bool:
    d = bitwise.compare_leaves(key, a, b)
    if d is not None:
      details.setdefault(_module_of(key) if ':' in key else key, d.detail)
      details.setdefault(key, d.detail)
    return d is not None

  common = [k for k in linen.order if k in set(nnx_probe.order)]
  nnx_common = [k for k in nnx_probe.order if k in set(linen.order)]
  order_difference = next(
      ((i, a, b) for i, (a, b) in enumerate(zip(common, nnx_common)) if a != b), None)
  forward_call = None
  for call in common:
    subs = [k for k in linen.outputs if k.split(':')[0] == call]
    if any(k in nnx_probe.outputs and differs(linen.outputs[k], nnx_probe.outputs[k], k) for k in subs):
      forward_call = call
      details.setdefault(call, next(details[k] for k in subs if k in details))
      break
  forward, inside = None, False
  if forward_call is not None:
    forward = _module_of(forward_call)
    a, b = linen.inputs.get(forward_call), nnx_probe.inputs.get(forward_call)
    input_diff = None if a is None or b is None else bitwise.compare_leaves(forward_call, a, b)
    if input_diff is not None:
      details[forward_call] = 'its input: ' + input_diff.detail
      # Its input already differs, though every call before it agreed: the
      # difference arose in the parent's own code between its submodules.
      forward, inside = (forward.rsplit('/', 1)[0] if '/' in forward else ROOT), True
  cot_equal = {
      call for call in common
      if all(
          k in nnx_probe.cotangents and not differs(linen.cotangents[k], nnx_probe.cotangents[k], k)
          for k in linen.cotangents if k.split(':')[0] == call
      )
  }
  bad = [
      p for p in linen.param_grads
      if p in nnx_probe.param_grads and differs(linen.param_grads[p], nnx_probe.param_grads[p], p)
  ]
  unrecorded = tuple(dict.fromkeys(linen.unrecorded + nnx_probe.unrecorded))
  backward = []
  backward_ulp: dict[str, int | None] = {}
  claimed: set[str] = set()
  # Innermost first: a module claims the differing gradients of its own
  # parameters when its output cotangent is equal; its parents then do not.
  # Modules of one depth in the backward pass's order (the forward's reversed),
  # so the first one named is the same on every run.
  position = {call: i for i, call in enumerate(common)}
  for call in sorted(cot_equal, key=lambda c: (-_depth(_module_of(c)), -position[c])):
    module = _module_of(call)
    mine = [p for p in bad if _under(p, module) and p not in claimed]
    if mine:
      backward.append((module, mine))
      claimed.update(mine)
      backward_ulp[module] = _max_ulp(
          (linen.param_grads[p], nnx_probe.param_grads[p]) for p in mine
      )
  return Localization(
      forward=forward,
      forward_call=forward_call,
      forward_inside=inside,
      forward_ulp=_forward_ulp(linen, nnx_probe, forward_call, inside),
      backward=backward,
      # A call whose counterpart runs inside a transformed body is not missing there.
      only_linen=[k for k in linen.order
                  if k not in set(nnx_probe.order) and k.split('#')[0] not in set(nnx_probe.unrecorded)],
      only_nnx=[k for k in nnx_probe.order
                if k not in set(linen.order) and k.split('#')[0] not in set(linen.unrecorded)],
      details=details,
      backward_ulp=backward_ulp,
      compared_calls=len(common),
      compared_grads=sum(p in nnx_probe.param_grads for p in linen.param_grads),
      only_linen_grads=[p for p in linen.param_grads if p not in nnx_probe.param_grads],
      only_nnx_grads=[p for p in nnx_probe.param_grads if p not in linen.param_grads],
      order_difference=order_difference,
      unrecorded=unrecorded,
      forward_unrecorded=_outermost_inside(forward, unrecorded) if inside else (),
  )


def _forward_ulp(linen: adapter.Probe, nnx_probe: adapter.Probe, call: str | None, inside: bool) -> int | None:
  if call is None:
    return None
  if inside:
    return bitwise.ulp_distance(linen.inputs[call], nnx_probe.inputs[call])
  keys = [k for k in linen.outputs if k.split(':')[0] == call and k in nnx_probe.outputs]
  return _max_ulp((linen.outputs[k], nnx_probe.outputs[k]) for k in keys)


def _max_ulp(pairs) -> int | None:
  """The largest ULP distance of the differing (Linen, NNX) value pairs.

  None when one of them has none: its dtypes or shapes differ, or it is not floats.
  """
  ulps = [bitwise.ulp_distance(a, b) for a, b in pairs if not bitwise.bitwise_equal(a, b)]
  return None if any(u is None for u in ulps) else max(ulps, default=0)
