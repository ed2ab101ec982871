"""Where two recorded passes part: the first differing module, forward and backward (`localize`)."""
from __future__ import annotations

import dataclasses
from typing import Any

from parity.compare.localize.probes import layers_opened
from parity.compare.localize.recording import ROOT, _LAYER, _SCANNED_LAYER, _split_call
from parity.core import bitwise
from parity.core import paths
from parity.pairs import adapter


@dataclasses.dataclass
class Localization:
  forward: str | None  # the module whose forward computation first differs
  forward_call: str | None  # the first module call whose output (or, inside, an argument) differs
  forward_inside: bool  # True: `forward` differs between its submodules' calls, not in one of them
  forward_ulp: int | None  # max ULP of the first differing value (an argument, inside); None: see _max_ulp
  backward: list[tuple[str, list[str]]]  # (module, its parameters whose gradients differ)
  only_linen: list[str]
  only_nnx: list[str]
  details: dict[str, str]  # path -> bitwise detail of the first differing values
  # True where each call of `only_linen` and `only_nnx` is of a module the other side records calls
  # under but does not call itself (an NNX stack's layer whose scan body calls its submodule): its
  # submodules' calls are compared, and no body went unopened.
  only_containers: bool = False
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
  # With `forward_inside`: the argument of `forward_call` that differs (its name in the
  # method's signature, Linen's), made by `forward`'s code.
  forward_argument: str | None = None
  # Linen call key -> the NNX name of the same call, where they differ (RecordedProbe.nnx_names):
  # the lines name a module by both sides' paths, `LayerNorm_1 (NNX: ln2)`.
  nnx_names: dict[str, str] = dataclasses.field(default_factory=dict)
  # The two probes compared (Linen's, NNX's): `localize_step` keeps them for the grads part.
  probes: tuple[Any, ...] | None = dataclasses.field(default=None, repr=False)
  # The opened scans that slice no parameters by their index (a recurrent cell's loop over time
  # steps, not a stack of layers): a module inside one is reported with its iteration.
  loops: tuple[str, ...] = ()
  # 'Linen' or 'NNX': the side whose `forward_call` returned its input unchanged where the
  # other's did not (a dropout off in this mode, a layer skipped); None: neither, or both.
  forward_unchanged: str | None = None

  def _call(self, key: str) -> str:
    """A call's key, with its NNX name after it where that differs."""
    own = self.nnx_names.get(key)
    return key if own is None else f'{key} (NNX: {own})'

  def _module(self, module: str) -> str:
    """A module's Linen path, with its NNX path after it where that differs (read off its
    first call found, `__call__` first)."""
    calls = [module] + [k for k in self.nnx_names if k != module and _module_of(k) == module]
    own = next((_module_of(self.nnx_names[k]) for k in calls if k in self.nnx_names), None)
    return module if own is None or own == module else f'{module} (NNX: {own})'

  def unchanged_note(self) -> str:
    """What `forward_unchanged` tells, after a forward difference's line ('' where it is None)."""
    if self.forward_unchanged is None:
      return ''
    return (f'; {self.forward_unchanged}\'s call returned its input unchanged and the other side\'s did'
            ' not: a dropout off in this mode (deterministic), or a layer skipped')

  def first(self, step: int | None = None) -> dict[str, Any] | None:
    """The first divergent module: `{step, path, layer, iteration, pass, max_ulp}` (None: none
    found).

    A layer of a stack (`.../layers_<i>/...`, as the unscanned twin of a
    scanned stack names it; `<stack>/<i>/...`, a scanned stack's layer as the
    opened probes name it) is reported as the stack's path with its index as
    `layer`; a module inside a loop that slices no parameters (`loops`: an
    RNN's steps), with its index as `iteration`.
    """
    if self.forward is not None:
      module, pass_name, ulp = self.forward, 'forward', self.forward_ulp
    elif self.backward:
      module = self.backward[0][0]
      pass_name, ulp = 'backward', self.backward_ulp[module]
    else:
      return None
    iteration = None
    m = _LAYER.search(module)
    if m is not None:
      layer = int(m.group(2))
      path = module[:m.start()] + m.group(1) + 'layers' + m.group(3) + module[m.end():]
    else:  # a layer of an opened scan, `<stack>/<layer>/...`, or an iteration of a loop
      m = _SCANNED_LAYER.search(module)
      layer = None if m is None else int(m.group(2))
      path = module if m is None else (module[:m.start()] + module[m.end():]).lstrip('/')
      if m is not None and module[:m.start()] in self.loops:
        layer, iteration = None, layer
    return {'step': step, 'path': path.rstrip('/'), 'layer': layer, 'iteration': iteration,
            'pass': pass_name, 'max_ulp': ulp}

  @property
  def clean(self) -> bool:
    return self.forward is None and not self.backward

  def lines(self) -> list[str]:
    out = []
    if self.forward is not None and self.forward_inside and _module_of(self.forward_call) == ROOT:
      out.append(
          f'forward pass: the input of {self.forward_call} differs ({self.details[self.forward_call]}):'
          ' the sides call the model with other arguments, made outside every recorded module call'
      )
    elif self.forward is not None and self.forward_inside and self.forward_unrecorded:
      out.append(
          f'forward pass: inside module {self._module(self.forward)}: the input of'
          f' {self._call(self.forward_call)} differs'
          f' while every earlier recorded call agrees ({self.details[self.forward_call]}); it arose'
          f' in a call not recorded there, {_shown(self.forward_unrecorded)} (inside a transformed'
          f' body), or in {self.forward}\'s own code between its submodules'
      )
    elif self.forward is not None and self.forward_inside:
      out.append(
          f'forward pass: inside module {self._module(self.forward)}, outside its submodules: the'
          f' input of {self._call(self.forward_call)} differs while every earlier call agrees'
          f' ({self.details[self.forward_call]})'
      )
    elif self.forward is not None:
      method = _method_of(self.forward_call)
      shown = f'module {self._module(self.forward)}' + (f', in its method {method}' if method else '')
      out.append(f'forward pass: first differs at {shown} ({self.details[self.forward_call]}){self.unchanged_note()}')
    else:
      out.append('forward pass: every module output bitwise equal')
    for module, params in self.backward:
      shown = ', '.join(f'{p} ({self.details[p]})' for p in params)
      out.append(
          f'backward pass: inside module {self._module(module)}: output cotangent bitwise equal,'
          f' gradients differ: {shown}'
      )
    if not self.backward:
      out.append('backward pass: every parameter gradient bitwise equal'
                 if self.forward is None else 'backward pass: not localized (the forward differs)')
    if self.order_difference is not None:
      i, a, b = self.order_difference
      out.append(f'module calls in another order: call {i} of those on both sides is {a} in Linen,'
                 f' {self._call(b)} in NNX (a rename rule that maps an NNX module to another Linen path'
                 ' reads so)')
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
  """The module of a call's key (or of one of its outputs, `key:sub`)."""
  return _split_call(key.split(':', 1)[0])[0]


def _method_of(key: str) -> str | None:
  """The method of a call's key (None: `__call__`)."""
  suffix = _split_call(key.split(':', 1)[0])[1]
  return suffix[1:].split('#', 1)[0] if suffix.startswith('.') else None


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
  the Linen side's state before it, with the layers of scanned stacks opened
  (`layers_opened`).
  """
  states = [side.from_checkpoint(linen_state) for side in (linen, nnx_side)]

  def probed():
    probes = tuple(side.probe(state, batch, key) for side, state in zip((linen, nnx_side), states))
    return dataclasses.replace(localize(*probes), probes=probes)

  try:
    with layers_opened():  # each layer of a scanned stack recorded
      opened = probed()
  except Exception:  # a body the recorder cannot open: probed as it is, its calls not recorded
    return probed()
  if not (opened.only_linen or opened.only_nnx) or opened.only_containers:
    return opened
  # Calls on one side only: a body one side opens where the other's cannot be (a transform
  # made before the probe, say); unopened, both list their calls as not recorded.
  plain = probed()
  return plain if not (plain.only_linen or plain.only_nnx) else opened


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
  forward_call, argument = None, None
  nnx_calls = set(nnx_probe.order)
  # Execution order: a call's arguments as it starts, its output as it returns (a probe
  # without its calls' starts: outputs alone, a differing one's arguments compared then).
  events = getattr(linen, 'events', None) or [('return', k) for k in linen.order]
  starts = any(kind == 'call' for kind, _ in events)
  for kind, call in events:
    if call not in nnx_calls:
      continue
    if kind == 'call':
      argument = _argument_difference(linen.inputs.get(call), nnx_probe.inputs.get(call), call)
      if argument is not None:
        forward_call = call
        break
      continue
    subs = [k for k in linen.outputs if k.split(':')[0] == call]
    if any(k in nnx_probe.outputs and differs(linen.outputs[k], nnx_probe.outputs[k], k) for k in subs):
      forward_call = call
      details.setdefault(call, next(details[k] for k in subs if k in details))
      if not starts:
        argument = _argument_difference(linen.inputs.get(call), nnx_probe.inputs.get(call), call)
      break
  forward, inside, forward_ulp, unchanged = None, False, None, None
  if forward_call is not None and argument is None:
    forward = _module_of(forward_call)
    keys = [k for k in linen.outputs if k.split(':')[0] == forward_call and k in nnx_probe.outputs]
    forward_ulp = _max_ulp((linen.outputs[k], nnx_probe.outputs[k]) for k in keys)
    sides = [name for name, probe in (('Linen', linen), ('NNX', nnx_probe)) if _returns_its_input(probe, forward_call)]
    unchanged = sides[0] if len(sides) == 1 else None
  elif forward_call is not None:
    # An argument differs while every earlier call agrees: the module that made it, its
    # caller, computes otherwise in its own code between its submodules' calls (the one
    # that received it is not to blame).
    name, diff, a, b = argument
    details[forward_call] = f'its argument {name}: {diff.detail}'
    caller = _caller(linen, nnx_probe, forward_call)
    forward, inside, forward_ulp = (ROOT if caller is None else _module_of(caller)), True, bitwise.ulp_distance(a, b)
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
  stacked = _stacked(linen, nnx_probe)
  for call in sorted(cot_equal, key=lambda c: (-_depth(_module_of(c)), -position[c])):
    module = _module_of(call)
    layer = _layer_params(module, stacked, [p for p in bad if p not in claimed])
    if layer is not None:  # a layer of a scanned stack: its slice of the stacked gradients
      index, params = layer
      pairs = {p: (linen.param_grads[p][index], nnx_probe.param_grads[p][index]) for p in params}
      mine = [p for p, (a, b) in pairs.items() if differs(a, b, f'{p}@{index}')]
      for p in mine:
        details[p] = f'layer {index}: ' + details[f'{p}@{index}']
    else:
      mine = [p for p in bad if _under(p, module) and p not in claimed]
      pairs = {p: (linen.param_grads[p], nnx_probe.param_grads[p]) for p in mine}
    if mine:
      backward.append((module, mine))
      claimed.update(mine)
      backward_ulp[module] = _max_ulp(pairs[p] for p in mine)
  return Localization(
      forward=forward,
      forward_call=forward_call,
      forward_inside=inside,
      forward_ulp=forward_ulp,
      backward=backward,
      # A call whose counterpart runs inside a transformed body is not missing there.
      only_linen=(only_linen := _one_sided(linen.order, nnx_probe)),
      only_nnx=(only_nnx := _one_sided(nnx_probe.order, linen)),
      only_containers=(all(_contains(k, nnx_probe.order) for k in only_linen)
                       and all(_contains(k, linen.order) for k in only_nnx)),
      details=details,
      backward_ulp=backward_ulp,
      compared_calls=len(common),
      compared_grads=sum(p in nnx_probe.param_grads for p in linen.param_grads),
      only_linen_grads=[p for p in linen.param_grads if p not in nnx_probe.param_grads],
      only_nnx_grads=[p for p in nnx_probe.param_grads if p not in linen.param_grads],
      order_difference=order_difference,
      unrecorded=unrecorded,
      forward_unrecorded=_outermost_inside(forward, unrecorded) if inside else (),
      forward_argument=argument[0] if argument is not None else None,
      nnx_names=dict(getattr(nnx_probe, 'nnx_names', None) or {}),
      loops=_loops(linen, nnx_probe),
      forward_unchanged=unchanged,
  )


def _returns_its_input(probe: adapter.Probe, call: str) -> bool:
  """Whether `call` returned one array bitwise equal to one of its arguments (a dropout that did
  not drop, a layer that passed its input through)."""
  outs = [v for k, v in probe.outputs.items() if k.split(':')[0] == call]
  if len(outs) != 1 or not hasattr(outs[0], 'shape'):
    return False
  out = outs[0]
  return any(hasattr(x, 'shape') and bitwise.compare_leaves(call, x, out) is None
             for x in _arguments(probe.inputs.get(call)).values())


def _one_sided(order: list[str], other: adapter.Probe) -> list[str]:
  """The calls of `order` the other side does not make: neither inside a transformed body
  there, nor a method call (`embed.attend`), which the other side may compute in its
  caller's code (compared where both make it)."""
  made, unrecorded = set(other.order), set(other.unrecorded)
  return [k for k in order if k not in made and _module_of(k) not in unrecorded and _method_of(k) is None]


def _contains(call: str, order: list[str]) -> bool:
  """Whether `order` (the other side's calls) holds calls of modules under `call`'s module."""
  module = _module_of(call)
  return module != ROOT and any(_module_of(k).startswith(module + '/') for k in order)


def _stacked(linen: adapter.Probe, nnx_probe: adapter.Probe) -> dict[str, tuple[str, ...]]:
  """The stacks both probes opened, each with the parameters both slice by layer on axis 0."""
  a, b = getattr(linen, 'stacked', {}), getattr(nnx_probe, 'stacked', {})
  return {stack: tuple(p for p in a[stack] if p in b[stack]) for stack in a if stack in b
          if a[stack] or b[stack]}


def _loops(linen: adapter.Probe, nnx_probe: adapter.Probe) -> tuple[str, ...]:
  """The scans both probes opened that slice no parameters on either side: loops (an RNN's
  over its steps), not stacks of layers."""
  a, b = getattr(linen, 'stacked', {}), getattr(nnx_probe, 'stacked', {})
  return tuple(stack for stack in a if stack in b and not a[stack] and not b[stack])


def _layer_params(module: str, stacked: dict[str, tuple[str, ...]], params: list[str]):
  """(layer index, the stacked parameters of `params` under it) of a module `<stack>/<i>/...`
  in an opened stack; None for a module in none."""
  for stack, sliced in stacked.items():
    head, sep, rest = module.partition('/') if not stack else module[len(stack) + 1:].partition('/')
    if (stack and not module.startswith(stack + '/')) or not head.isdigit():
      continue
    inside = '/'.join(filter(None, (stack, rest)))
    return int(head), [p for p in params if p in sliced and _under(p, inside or ROOT)]
  return None


def _caller(linen: adapter.Probe, nnx_probe: adapter.Probe, call: str) -> str | None:
  """The call under way when `call` started (Linen's, else NNX's; for a probe that does not
  record callers, the module above it by path); None for an outermost call."""
  for probe in (linen, nnx_probe):
    callers = getattr(probe, 'callers', None)
    if callers:
      return callers.get(call)
  module = _module_of(call)
  return None if module == ROOT else (module.rsplit('/', 1)[0] if '/' in module else ROOT)


def _arguments(recorded: Any) -> dict[str, Any]:
  """A call's recorded arrays by argument name (a lone array: `input`)."""
  if recorded is None:
    return {}
  return dict(recorded) if isinstance(recorded, dict) else {'input': recorded}


def _unnamed(name: str) -> bool:
  """Whether an argument's name is only where it stands: a `*args` element (`*args/1`), or a
  position where no signature names it (`1`)."""
  head = name.split('/', 1)[0]
  return head.startswith('*') or head.isdigit()


def _alike(x: Any, y: Any) -> bool:
  return tuple(x.shape) == tuple(y.shape) and paths.dtype_name(x.dtype) == paths.dtype_name(y.dtype)


def _argument_difference(linen_args: Any, nnx_args: Any, call: str):
  """(name, difference, Linen's, NNX's) of the first argument of `call` that differs, in
  Linen's order; None where every argument found on both sides is bitwise equal.

  Arguments pair by what they are. Named on both sides (their signatures name them), by name.
  Otherwise (a `*args` element, a position no signature names, a name one side alone uses:
  `inputs` in one framework's layer, `x` in the other's) first with an argument of the other
  side it equals bit for bit, as two calls that get the same arrays in another order are the
  same call; what is left then in order, where shapes and dtypes agree, so a real difference
  is named with its argument. One given on one side only (an RNG key one framework takes at
  the call) is not compared.
  """
  a, b = _arguments(linen_args), _arguments(nnx_args)
  by_name = {n: n for n in a if n in b and not _unnamed(n)}
  rest = [n for n in b if n not in by_name.values()]
  pairs = dict(by_name)
  for name, x in a.items():  # the same array elsewhere on the other side
    if name in pairs:
      continue
    same = next((n for n in rest if _alike(x, b[n]) and bitwise.bitwise_equal(x, b[n])), None)
    if same is not None:
      pairs[name] = same
      rest.remove(same)
  for name, x in a.items():  # what is left: the same name, else in order where alike
    if name in pairs:
      continue
    other = name if name in rest else next((n for n in rest if _alike(x, b[n])), None)
    if other is not None:
      pairs[name] = other
      rest.remove(other)
  for name in a:
    if name not in pairs:
      continue
    x, y = a[name], b[pairs[name]]
    diff = bitwise.compare_leaves(f'{call}({name})', x, y)
    if diff is not None:
      return name, diff, x, y
  return None


def _max_ulp(pairs) -> int | None:
  """The largest ULP distance of the differing (Linen, NNX) value pairs.

  None when one of them has none: its dtypes or shapes differ, or it is not floats.
  """
  ulps = [bitwise.ulp_distance(a, b) for a, b in pairs if not bitwise.bitwise_equal(a, b)]
  return None if any(u is None for u in ulps) else max(ulps, default=0)
