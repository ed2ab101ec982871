"""What the canonical form names: arguments by state path, modules by their debug locations."""
from __future__ import annotations

import re


def _arg_name(path: str) -> str:
  """An SSA name for a state path: `params/params/x` -> `%params.params.x`."""
  return '%' + re.sub(r'[^\w$-]', '.', path if path[:1].isalpha() else f'_{path}')


# Module paths of operations, from the debug locations of a lowered program
# (`as_text(debug_info=True)`): `#loc7 = loc("jvp(Encoder)/layers_0/LayerNorm_0/mul"(#loc3))`
# and an operation's trailing `loc(#loc7)`.
_LOC_ALIAS = re.compile(r'^\s*(#loc\d*)\s*=\s*loc\((.*)\)\s*$')
_TRAILING_LOC = re.compile(r'\s*loc\((#loc\d*)\)\s*$')
_OPAQUE = re.compile(r'\s*\u27e6opaque ([^\u27e7]*)\u27e7')


def _location_names(text: str) -> dict[str, str]:
  """Each location alias's name-stack string ('' for file and unknown locations)."""
  bodies = {}
  for line in text.splitlines():
    m = _LOC_ALIAS.match(line)
    if m:
      bodies[m.group(1)] = m.group(2)

  def name(alias: str, depth: int = 0) -> str:
    body = bodies.get(alias, '')
    quoted = re.match(r'"((?:[^"\\]|\\.)*)"(:?)', body)
    if quoted:
      return '' if quoted.group(2) else quoted.group(1)  # `"file.py":12:3` is a file
    callsite = re.match(r'callsite\((#loc\d*) at ', body)
    if callsite and depth < 64:
      return name(callsite.group(1), depth + 1)
    return ''

  return {alias: name(alias) for alias in bodies}


# Name-stack components jax adds inside a module's path: jax.checkpoint's (nn.remat,
# nnx.remat), and a scan body's where it is inlined (jax 0.12: `while/body/eval_jaxpr/`).
_JAX_SCOPES = frozenset({'checkpoint', 'rematted_computation', 'eval_jaxpr'})
_LOOP_SCOPES = ('body', 'cond')  # after 'while'


def module_of(name: str, keep_first: bool = False) -> list[str]:
  """The module path in a name-stack string, its root module and the operation dropped.

  `transpose(jvp(Encoder))/layers_0/LayerNorm_0/mul` -> ['layers_0', 'LayerNorm_0'];
  a leading jitted function's name (`jit(apply)/Net/Dense_0/dot_general`) is not the root,
  nor the root's name repeated by a subclass calling `super().__call__` (`jvp(Net)/Net/...`).
  `keep_first`: the first component kept. Inside a scanned body (nn.scan,
  nnx.scan) lowered as a function of its own (jax 0.10), the name stack starts
  afresh at the stack's own name (`layers/LayerNorm_0/add`, no root), and
  nothing in the string tells the two apart; where the body is inlined (jax
  0.12: `jvp(Net)/while/body/eval_jaxpr/layers/LayerNorm_0/add`), the loop's
  components are not modules.
  """
  parts = name.split('/')
  while len(parts) > 1 and re.fullmatch(r'p?jit\(.*\)', parts[0]):
    parts = parts[1:]
  # Inside a rematerialised body the name stack repeats the root under the
  # transpose (`transpose(jvp(Net))/jvp(Net)/checkpoint/rematted_computation/...`):
  # the repeat and jax.checkpoint's own components are not modules.
  middle = []
  for i, p in enumerate(parts[1:-1], 1):
    loop = (p == 'while' and parts[i + 1] in _LOOP_SCOPES) or (p in _LOOP_SCOPES and parts[i - 1] == 'while')
    if '(' not in p and p not in _JAX_SCOPES and not loop:
      middle.append(p)
  parts = parts[:1] + middle + parts[-1:]
  parts = [re.sub(r'\)+$', '', re.sub(r'^(?:[\w.-]*\()+', '', p)) for p in parts]
  # A subclass's `__call__` calling `super().__call__` enters the root's name scope once more
  # (`jvp(MyModel)/MyModel/Dense_0/dot_general`): the repeat is the root, not a module.
  while len(parts) > 2 and parts[1] == parts[0]:
    del parts[1]
  return parts[0 if keep_first else 1:-1]


def _mark_opaque(text: str, modules: tuple[str, ...]) -> str:
  """Each operation located in one of `modules` marked (its location replaced by the marker).

  A module path matches the name stack read below the root, or from its
  first component: an operation of a scanned body is named from the stack
  (`layers/LayerNorm_0/add` for `layers/LayerNorm_0`, see `module_of`).
  """
  wanted = [(m, m.split('/')) for m in modules]
  names = _location_names(text)
  out = []
  for line in text.splitlines():
    m = _TRAILING_LOC.search(line)
    if m and not _LOC_ALIAS.match(line):
      name = names.get(m.group(1), '')
      found = (module_of(name), module_of(name, keep_first=True))
      hit = next((module for module, parts in wanted if any(p[:len(parts)] == parts for p in found)), None)
      if hit is not None:
        line = line[:m.start()] + f' \u27e6opaque {hit}\u27e7'
    out.append(line)
  return '\n'.join(out)
