"""Module correspondences inferred: which NNX module (and which of its calls) is which Linen module.

Linen names a stock model's modules automatically (`Dense_0`,
`MlpBlock_0/Dropout_1`); an NNX port names them by attribute (`mlp/linear1`,
`mlp/dropout`). The kit infers the mapping from one traced forward pass on
each side (`jax.eval_shape`: nothing is compiled): the module calls in the
order they return (`__call__` and the public methods a caller calls, such as
`Embed.attend`: `Embed_0.attend`; through any wrapper between the frameworks,
parity/compare/bridged.py), each with its class and the shapes and dtypes of
the parameters it owns and of those below it. The two call sequences are
aligned in order, a call pairing with a compatible one (same class, up to
the stock layers' renames such as `Dense` -> `Linear`, and the same
parameters); the alignment gives

- `renames`: Linen path -> NNX path of every module first called at a
  matched pair (what `Renames` holds), and
- `call_keys`: NNX call -> Linen call where calls do not pair one to one (one
  NNX module called k times where Linen has k modules, or the reverse): the
  localizer compares them call by call, and stock dropout draws each call's
  Linen key (parity/pairs/dropout.py).

Rules the user gives (`Renames`) win where they speak: no rule is inferred
for a path one covers, and a module a given rule pairs with one the other
side calls is paired. A module with parameters left without a counterpart
(the order cannot decide) ends in one `CorrespondenceError` listing each
with its candidates.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from parity.core import compat, paths
from parity.compare import bridged, scopes
from parity.pairs.stock_layout import Renames

ROOT = ''
# Stock Linen layer -> its NNX counterpart's class name, where flax names them apart.
STOCK_CLASSES = {
    'Dense': 'Linear',
    'DenseGeneral': 'LinearGeneral',
    'MultiHeadDotProductAttention': 'MultiHeadAttention',
    'SelfAttention': 'MultiHeadAttention',
    'ConvTranspose': 'ConvTranspose',
}


class CorrespondenceError(ValueError):
  """Modules the kit could not pair: each named, with its candidates on the other side."""


@dataclasses.dataclass(frozen=True)
class Call:
  """One module call, in the order calls return (children before their parent)."""

  key: str  # the module's path (`path.method` for a method's call), `#n` after it for its n-th repeat
  path: str
  cls: str
  own: tuple  # ((parameter name, shape, dtype), ...) of the parameters the module owns
  below: tuple  # sorted ((shape, dtype), ...) of every parameter at or below the module
  kinds: frozenset = frozenset()  # its class and base classes, by name (stock names as NNX's)
  method: str = '__call__'  # the method called (`attend`: key `path.attend`)
  # The module's class itself (the wrapper's, for a wrapper): a stock layer is told from a
  # same-named class of the project's own by it.
  module_type: Any = dataclasses.field(default=None, compare=False, repr=False)

  @property
  def label(self) -> str:
    return f'{self.key or "(model)"} ({self.cls})'


@dataclasses.dataclass(frozen=True)
class Correspondence:
  renames: Renames
  call_keys: tuple[tuple[str, str], ...] = ()  # (NNX call by its Linen path, Linen call)
  inferred: tuple[tuple[str, str], ...] = ()  # the rules inferred (not the user's)

  def python(self, name: str = 'RENAMES') -> str:
    """The table as Python a user can paste into their pair and edit."""
    lines = [f'{name} = parity.Renames((  # Linen path -> NNX path']
    lines += [f'    ({linen!r}, {nnx_path!r}),' for linen, nnx_path in self.renames.rules]
    lines.append('))')
    if self.call_keys:
      lines.append('# Calls that do not pair one to one (inferred, nothing to write): NNX call -> Linen call')
      lines += [f'#   {n} -> {l}' for n, l in self.call_keys]
    return '\n'.join(lines)


def _param_groups(flat: dict[str, Any]) -> dict[str, list[tuple[str, tuple, str]]]:
  groups: dict[str, list] = collections.defaultdict(list)
  for path, x in flat.items():
    module, _, name = path.rpartition('/')
    groups[module].append((name, tuple(x.shape), paths.dtype_name(x.dtype)))
  return groups


def _kinds(cls: type) -> frozenset:
  return frozenset(_normal_class(c.__name__) for c in cls.__mro__
                   if c not in (object, nn.Module, nnx.Module) and not c.__module__.startswith(('abc', 'typing')))


def _calls(order: list[tuple[str, str, type, type | None]], flat_params: dict[str, Any]) -> list[Call]:
  groups = _param_groups(flat_params)
  seen: collections.Counter = collections.Counter()
  out = []
  for path, method, cls_type, wrapped in order:
    cls = cls_type.__name__
    name = path if method == '__call__' else f'{path}.{method}'
    n = seen[name]
    seen[name] += 1
    below = sorted(
        (shape, dtype) for module, params in groups.items()
        if module == path or not path or module.startswith(path + '/')
        for _, shape, dtype in params
    )
    # A wrapper is also of the class it wraps (a ToLinen of an NNX Mlp pairs as an Mlp).
    kinds = _kinds(cls_type) | (_kinds(wrapped) if wrapped is not None else frozenset())
    out.append(Call(name if n == 0 else f'{name}#{n}', path, cls, tuple(sorted(groups.get(path, ()))),
                    tuple(below), kinds, method, cls_type))
  return out


def _recorded(order: list[tuple[str, str, type, type | None]]) -> bridged.OnCall:
  """Each module call appended to `order` as it returns (children before their parent):
  its path, method, class and, for a wrapper, the class of the module it runs."""

  def on_call(path, module, arguments, run):
    y = run()
    order.append((path, arguments.method, type(module), arguments.wrapped))
    return y

  return on_call


def linen_calls(linen_side: Any, state: Any, batch: Any, key: Any) -> list[Call]:
  """The Linen side's module calls in one traced train-mode loss (`loss(params, state, batch, key)`)."""
  order: list[tuple[str, str, type, type | None]] = []

  def traced(state):
    del order[:]
    with bridged.linen_calls(_recorded(order)):
      return linen_side.loss(state.params, state, batch, key)

  jax.eval_shape(traced, state)
  return _calls(order, paths.flatten(state.params))


def nnx_calls(nnx_side: Any, state: Any, batch: Any, key: Any) -> list[Call]:
  """The NNX side's module calls in one traced train-mode loss (`loss(model, batch, key)`)."""
  order: list[tuple[str, str, type, type | None]] = []

  def traced(state):
    with compat.eager_sharding_off():
      model, _ = nnx.merge(nnx_side.graphdef, state)
    scopes.tag_paths(model, lambda p: p)
    del order[:]
    with bridged.nnx_calls(_recorded(order)):
      return nnx_side.loss(model, batch, key)

  jax.eval_shape(traced, state)
  return _calls(order, _nnx_params(state))


def _nnx_params(state: Any) -> dict[str, Any]:
  """The model's parameters (`0/<path>` of the (model, optimizer) state) by their NNX path."""
  types = {p: type(v) for p, v in paths.items(state, lambda x: isinstance(x, nnx.Variable)) if isinstance(v, nnx.Variable)}
  flat = paths.flatten(state)
  return {p[2:]: flat[p] for p, t in types.items() if p.startswith('0/') and issubclass(t, nnx.Param)}


def _normal_class(cls: str) -> str:
  return STOCK_CLASSES.get(cls, cls)


def _compatible(a: Call, b: Call) -> bool:
  """Same parameters (own and below, by shape and dtype), and the same class where neither has any."""
  if a.below != b.below:
    return False
  if [(s, d) for _, s, d in a.own] != [(s, d) for _, s, d in b.own] and sorted(
      (s, d) for _, s, d in a.own) != sorted((s, d) for _, s, d in b.own):
    return False
  return _same_kind(a, b) or bool(a.below)


def _bonus(a: Call, b: Call) -> int:
  """How well two calls pair: 2 compatible and of one class, 1 compatible only, or of one class
  owning no parameters with other parameters below (a container whose submodule Linen keeps in
  another scope: `nn.RNN`'s cell is its parent's), 0 not at all (calls of other methods)."""
  if a.method != b.method:
    return 0
  if _compatible(a, b):
    return 2 if _same_kind(a, b) else 1
  return 1 if not a.own and not b.own and _same_kind(a, b) else 0


def _same_kind(a: Call, b: Call) -> bool:
  """The same class (stock Linen names as NNX's), or one derived from the other's."""
  return _normal_class(a.cls) == _normal_class(b.cls) or _normal_class(a.cls) in b.kinds or _normal_class(b.cls) in a.kinds


def _align(linen: list[Call], nnx_: list[Call]) -> list[tuple[int, int]]:
  """The longest order-preserving pairing of calls that pair (`_bonus`; ties: the better first)."""
  n, m = len(linen), len(nnx_)
  bonus = [[_bonus(a, b) for b in nnx_] for a in linen]
  score = [[0] * (m + 1) for _ in range(n + 1)]
  for i in range(n - 1, -1, -1):
    for j in range(m - 1, -1, -1):
      best = max(score[i + 1][j], score[i][j + 1])
      if bonus[i][j]:
        best = max(best, score[i + 1][j + 1] + bonus[i][j])
      score[i][j] = best
  pairs, i, j = [], 0, 0
  while i < n and j < m:
    if bonus[i][j] and score[i][j] == score[i + 1][j + 1] + bonus[i][j]:
      pairs.append((i, j))
      i, j = i + 1, j + 1
      continue
    if score[i][j] == score[i + 1][j]:
      i += 1
    else:
      j += 1
  return pairs


def _shapes(call: Call) -> str:
  """The shapes of the parameters at or below `call`, each with its count."""
  counts = collections.Counter(str(list(shape)) for shape, _ in call.below)
  return ', '.join(f'{shape} x{n}' if n > 1 else shape for shape, n in counts.items()) or 'none'


def _other_layouts(linen: list[Call], nnx_: list[Call], pairs: list[tuple[int, int]]) -> list[str]:
  """A note for each layer paired by its class and place whose parameters differ (no rename can
  pair those: the two sides store the layer's parameters in other layouts)."""
  differ = [(linen[i], nnx_[j]) for i, j in pairs
            if linen[i].below != nnx_[j].below and linen[i].below and nnx_[j].below and _same_kind(linen[i], nnx_[j])]
  notes = []
  for a, b in differ:
    # The innermost such layers only: a model holding one holds other parameters too.
    if not any(c is not a and (not a.path or c.path.startswith(a.path + '/')) for c, _ in differ):
      notes.append(
          f'Linen {a.label} and NNX {b.label} are the same layer at the same place, but hold other'
          f' parameters (Linen: {_shapes(a)}; NNX: {_shapes(b)}): no rename pairs them. The two'
          ' sides store this layer\'s parameters in other layouts (flax\'s own Linen and NNX versions'
          ' of a layer can: OptimizedLSTMCell does); port the layer so that both hold the same parameters.')
  return notes


def _first_calls(calls: list[Call]) -> list[int]:
  """The index of each module's first call (of any method)."""
  first: dict[str, int] = {}
  for i, c in enumerate(calls):
    first.setdefault(c.path, i)
  return sorted(first.values())


def _covered(rules: tuple[tuple[str, str], ...], path: str) -> bool:
  return any(path == l or path.startswith(l + '/') for l, _ in rules)


def infer(linen: list[Call], nnx_: list[Call], given: Renames = Renames()) -> Correspondence:
  """The correspondence of two call sequences; `given` rules win where they speak."""
  pairs = _align(linen, nnx_)
  renames: dict[str, str] = {}
  nnx_first_linen: dict[str, str] = {}  # NNX module path -> the Linen path its first call matched
  matched_linen = {i for i, _ in pairs}
  matched_nnx = {j for _, j in pairs}
  for i, j in pairs:
    l, n = linen[i], nnx_[j]
    if n.path not in nnx_first_linen and l.path not in renames:
      nnx_first_linen[n.path] = l.path
      renames[l.path] = n.path
  rules = tuple(given.rules)
  inferred = tuple(
      (l, n) for l, n in renames.items()
      if l != n and l != ROOT and not _covered(given.rules, l)
  )
  # Keep only what longest-prefix matching does not already give: parents first.
  needed: list[tuple[str, str]] = []
  for l, n in sorted(inferred, key=lambda rule: rule[0].count('/')):
    if Renames(rules + tuple(needed)).to_nnx(l) != n:
      needed.append((l, n))
  # Shown in call order, each module before the modules inside it.
  first = {}
  for index, c in enumerate(linen):
    for depth in range(c.path.count('/') + 1):
      first.setdefault('/'.join(c.path.split('/')[:depth + 1]), index)
  needed.sort(key=lambda rule: (first.get(rule[0], len(linen)), rule[0].count('/')))
  table = Renames(rules + tuple(needed))
  call_keys = []
  for i, j in pairs:
    l, n = linen[i], nnx_[j]
    as_linen = table.to_linen(n.path) + n.key[len(n.path):]
    if as_linen != l.key:
      call_keys.append((as_linen, l.key))
  problems = []
  # Each module with parameters, once: paired where one of its calls is, or where the table
  # (the given rules, then the inferred) names a module the other side calls.
  paired_linen, paired_nnx = {linen[i].path for i in matched_linen}, {nnx_[j].path for j in matched_nnx}
  for i in _first_calls(linen):
    c = linen[i]
    if c.path not in paired_linen and c.own and table.to_nnx(c.path) not in {d.path for d in nnx_}:
      candidates = [nnx_[k].label for k in _first_calls(nnx_) if nnx_[k].own
                    and sorted(s for _, s, _ in nnx_[k].own) == sorted(s for _, s, _ in c.own)]
      problems.append(f'Linen {c.label}: no NNX module matched; candidates: {", ".join(candidates) or "none"}')
  for j in _first_calls(nnx_):
    c = nnx_[j]
    if c.path not in paired_nnx and c.own and table.to_linen(c.path) not in {d.path for d in linen}:
      candidates = [linen[k].label for k in _first_calls(linen) if linen[k].own
                    and sorted(s for _, s, _ in linen[k].own) == sorted(s for _, s, _ in c.own)]
      problems.append(f'NNX {c.label}: no Linen module matched; candidates: {", ".join(candidates) or "none"}')
  if problems:
    raise CorrespondenceError(
        'module correspondences: ' + str(len(problems)) + ' module(s) could not be paired by call order,'
        ' class and parameter shapes; give their names with Renames (your rules win where they speak):\n  '
        + '\n  '.join(problems) + ''.join('\n' + note for note in _other_layouts(linen, nnx_, pairs))
    )
  return Correspondence(table, tuple(call_keys), tuple(needed))
