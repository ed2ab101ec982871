"""Compare the two sides' train-step programs as text, and read their shardings.

Two lowered programs can spell one computation differently: SSA value names,
private function names (`@_where_41` vs `@_where_40`: jax numbers them as it
traces), debug locations, the `jax.result_info` labels of the pytree paths,
the order in which the pytree flattening lays out arguments and results
(a Linen `TrainState` flattens `step` first, an NNX state last), the order in
which independent operations were traced, operations nothing uses, and
constants repeated per use. None of that is the computation, so
`canonicalize` removes all of it (it reads the program as a dataflow graph);
what is left differs only where the computation does, and `diff` shows where.

The order of a loop's carried values is spelling too: Linen's `nn.scan` and
a `jax.lax.scan` over `nnx.split` state carry the same values in another
order. Every loop is read with its carried values ordered by what they are,
so such loops are the same program. XLA's scheduler starts from that
order, and XLA:GPU has scheduled one loop body otherwise for it (the fp8
decoder on an H100: +32 KiB of temporaries, every number bitwise equal;
XLA:CPU gave equal memory): the memory part measures that, and where the
canonical programs are identical `diff` notes such a loop
(`loop_order_difference`; loops paired by what they carry, not by where
the text prints them) without calling it a difference.

`sharding_annotations` reads the sharding attributes of a lowered program
(GSPMD `mhlo.sharding` and Shardy `sdy.sharding` spellings), so tests can
assert that both sides' programs carry the same shardings.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import hashlib
import heapq
import re
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------
# Canonical form
# ---------------------------------------------------------------------------

# Attributes that only label things for humans or debuggers. Shardings,
# donation and aliasing attributes stay: they change the compiled program.
_LABEL_ATTRS = ('jax.result_info', 'jax.arg_info', 'mhlo.frontend_attributes')
_SSA = re.compile(r'%[A-Za-z_][\w$.-]*|%\d+')
_SYMBOL = re.compile(r'@[\w$.-]+|@"[^"]*"')
_FUNC_HEADER = re.compile(r'^(\s*)func\.func\s+(public|private)?\s*(@[\w$.-]+)\((.*)$')


def _strip_locations(text: str) -> str:
  """Drops `#loc...` alias lines and every `loc(...)` (which may nest)."""
  lines = [l for l in text.splitlines() if not re.match(r'\s*#loc\w*\s*=', l)]
  text = '\n'.join(lines)
  out, i = [], 0
  while True:
    j = text.find('loc(', i)
    if j < 0:
      out.append(text[i:])
      break
    # `loc(` inside an identifier (e.g. `alloc(`) is not a location.
    if j > 0 and (text[j - 1].isalnum() or text[j - 1] in '_.'):
      out.append(text[i:j + 4])
      i = j + 4
      continue
    out.append(text[i:j].rstrip(' '))
    depth, k = 0, j + 3
    while k < len(text):
      if text[k] == '(':
        depth += 1
      elif text[k] == ')':
        depth -= 1
        if depth == 0:
          break
      elif text[k] == '"':
        k = text.index('"', k + 1)
      k += 1
    i = k + 1
  return ''.join(out)


def _strip_label_attrs(text: str) -> str:
  for attr in _LABEL_ATTRS:
    # `attr = "..."` or `attr = {...}` (no nested braces in these labels).
    text = re.sub(rf',?\s*{re.escape(attr)}\s*=\s*("(?:[^"\\]|\\.)*"|\{{[^{{}}]*\}})', '', text)
  text = re.sub(r'\{\s*,\s*', '{', text)
  # An attribute dictionary left empty disappears altogether.
  return re.sub(r'\s*\{\s*\}', '', text)


def _split_top_level(s: str, sep: str = ',') -> list[str]:
  """Splits on `sep` outside (), <>, {}, [] and strings."""
  parts, depth, start, in_str = [], 0, 0, False
  for i, ch in enumerate(s):
    if in_str:
      if ch == '"' and s[i - 1] != '\\':
        in_str = False
      continue
    if ch == '"':
      in_str = True
    elif ch in '(<{[':
      depth += 1
    elif ch in ')>}]':
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:])
  return [p.strip() for p in parts if p.strip()]


def _matching_paren(s: str, open_index: int) -> int:
  depth = 0
  for i in range(open_index, len(s)):
    if s[i] == '(':
      depth += 1
    elif s[i] == ')':
      depth -= 1
      if depth == 0:
        return i
  raise ValueError('unbalanced parentheses in a function signature')


@dataclasses.dataclass
class _Function:
  header_indent: str
  visibility: str
  name: str
  args: list[tuple[str, str]]  # (ssa name, type and attributes)
  results: str  # the text after `->`, up to the body's `{`
  body: list[str]


def _parse_functions(text: str) -> list[_Function | str]:
  """Splits a module into function records and the lines between them."""
  lines = text.splitlines()
  items: list[_Function | str] = []
  i = 0
  while i < len(lines):
    m = _FUNC_HEADER.match(lines[i])
    if not m:
      items.append(lines[i])
      i += 1
      continue
    indent, visibility, name = m.group(1), m.group(2) or '', m.group(3)
    header = lines[i]
    open_index = header.index('(', header.index(name))
    close = _matching_paren(header, open_index)
    args = []
    for part in _split_top_level(header[open_index + 1:close]):
      ssa, _, rest = part.partition(':')
      args.append((ssa.strip(), rest.strip()))
    tail = header[close + 1:].strip()
    if tail.endswith('{'):
      tail = tail[:-1].strip()
    results = tail[2:].strip() if tail.startswith('->') else tail
    body = []
    i += 1
    # The body ends at the closing brace at the header's own indentation.
    while i < len(lines) and lines[i] != f'{indent}}}':
      body.append(lines[i])
      i += 1
    i += 1
    items.append(_Function(indent, visibility, name, args, results, body))
  return items



# ---------------------------------------------------------------------------
# Canonical form: each program as a dataflow graph
# ---------------------------------------------------------------------------
#
# Every value is named by a hash of what computes it: its operation, types,
# attributes and the names of its operands (so, recursively, the whole
# computation it depends on). Then:
#   - the order in which jax emitted independent operations does not matter
#     (each block is printed in a topological order that sorts ready
#     operations by name);
#   - dead code goes (an operation nothing live uses; XLA removes it too);
#   - two identical operations are one (jax repeats constants per use), and
#     `transpose(transpose(x))` that restores x is x (NNX's scan transposes
#     the stacked layer variables to the scan axis and back);
#   - a private function is read per call, its arguments named by what the
#     caller passes, its results in the order of their names, and named by
#     the hash of that reading: the order in which jax collected a function's
#     arguments and results (e.g. the residuals a layer saves for the
#     backward pass) does not matter, nor do function names;
#   - every while loop's carried values are put in an order of their own (by
#     type, initial value and what the body returns for them, refined until
#     values that still tie are one value: `_carry_classes`), for the same
#     reason;
#   - @main's arguments are numbered by first use (looking into calls), its
#     results sorted by name: the pytree order of each side's state does not
#     matter.
# Two programs whose canonical forms are equal compute the same dataflow
# graph, operation for operation, type for type, attribute for attribute,
# sharding for sharding. A real difference changes the name of the value it
# defines and of every value that depends on it, so the diff shows the
# difference and what it feeds, not a renumbering of everything after it.

_TOKEN_HEX = 16
_VALUE_TOKEN = re.compile(r'%v[0-9a-f]{' + str(_TOKEN_HEX) + '}')
_FUNC_TOKEN = re.compile(r'@f[0-9a-f]{' + str(_TOKEN_HEX) + '}')
_LHS = re.compile(r'^(%[\w$.-]+(?::\d+)?(?:\s*,\s*%[\w$.-]+(?::\d+)?)*)\s*=\s')
_STATEMENT_START = re.compile(r'^(%|"?[a-z_]+\.[\w.]+|return\b|call\b)')
_STRUCTURE = ('^', '}', 'cond', 'reducer')
_TERMINATORS = re.compile(r'^(return|func\.return|stablehlo\.return|"stablehlo\.return")\b')
_PLACEHOLDER = '%_'
_TRANSPOSE = re.compile(r'^%_ = stablehlo\.transpose (%[\w$.-]+), dims = \[([\d, ]+)\]')
_INDENT = '  '


def _hash(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:_TOKEN_HEX]


def _indent_of(line: str) -> int:
  return len(line) - len(line.lstrip(' '))


def _split_statements(lines: list[str]) -> list[list[str]]:
  """A block's lines grouped into statements: an operation with its regions."""
  lines = [l for l in lines if l.strip()]
  if not lines:
    return []
  base = _indent_of(lines[0])
  statements: list[list[str]] = []
  for line in lines:
    if not statements or (_indent_of(line) <= base and _STATEMENT_START.match(line.strip())):
      statements.append([line])
    else:
      statements[-1].append(line)
  return statements


@dataclasses.dataclass
class _Statement:
  lines: list[str]  # canonical, LHS as placeholder, relative indentation
  defs: list[tuple[str, str]]  # (SSA name, token)
  refs: set[str]  # SSA names used anywhere in it (regions included)
  token: str  # hash of `lines`
  terminator: bool
  side_effect: bool
  # `%name#k` -> `%token#j` where results are put in a canonical order.
  aliases: dict[str, str] = dataclasses.field(default_factory=dict)
  opaque_module: str | None = None  # set for an operation left out of the comparison


# A reference to a value, or to one result of a multi-result operation.
_REF = re.compile(r'(%[A-Za-z_][\w$.-]*|%\d+)(#\d+)?')
_WHILE = re.compile(r'^(%_(?::\d+)?) = stablehlo\.while\((.*)\) : (.*)$')
_CASE = re.compile(r'^%_(?::\d+)? = "stablehlo\.(?:case|if)"\(')
_RESULT_TYPES = re.compile(r'^(.*-> )\((.*)\)$')
_BARRIER = re.compile(r'^(%_(?::\d+)?) = stablehlo\.optimization_barrier (.*) : (.*)$')
_CALL_OPERANDS = re.compile(r'\bcall (@[\w$.-]+)\(([^()]*)\)')
_CALL_LINE = re.compile(
    r'^(%_(?::\d+)? = )?((?:func\.)?call) (@[\w$.-]+)\(([^()]*)\) : \(([^()]*)\) -> (.*)$'
)
_RETURN = re.compile(r'^((?:func\.)?return|stablehlo\.return)\s+(.*?)\s*:\s*(.*)$')


def _substitute(text: str, scope: dict[str, str]) -> str:
  def one(m: re.Match) -> str:
    if m.group(0) in scope:
      return scope[m.group(0)]
    return scope.get(m.group(1), m.group(1)) + (m.group(2) or '')

  return _REF.sub(one, text)


def _permute_return(line: str, order: list[int]) -> str | None:
  """A `return a, b : ta, tb` line with operands and types in `order`."""
  m = _RETURN.match(line.strip())
  if not m:
    return None
  keyword, operands, types = m.group(1), _split_top_level(m.group(2)), _split_top_level(m.group(3))
  if not len(operands) == len(types) == len(order):
    return None
  indent = line[:_indent_of(line)]
  return (f'{indent}{keyword} {", ".join(operands[i] for i in order)}'
          f' : {", ".join(types[i] for i in order)}')


def _result_type(lines: list[str]) -> str:
  """` : <result type>` of an operation's text (its trailing type signature), or ''."""
  for line in (lines[-1], lines[0]):
    head = line.strip()
    if ' -> ' in head:
      return ' : ' + head.rsplit(' -> ', 1)[1]
    if ' : ' in head:
      return ' : ' + head.rsplit(' : ', 1)[1]
  return ''


def _return_operands(line: str) -> list[str] | None:
  m = _RETURN.match(line.strip())
  return _split_top_level(m.group(2)) if m else None


def _canonical_indices(keys: list[str]) -> tuple[list[int], dict[int, int]]:
  """The order sorting `keys`, and each old index's new one (equal keys: the first)."""
  order = sorted(range(len(keys)), key=lambda i: (keys[i], i))
  first: dict[str, int] = {}
  for new, old in enumerate(order):
    first.setdefault(keys[old], new)
  return order, {old: first[keys[old]] for old in range(len(keys))}


def _refined(classes: list[str], keys: list[str]) -> list[str]:
  """Each class split by the keys of its members (a refinement: no two classes merge)."""
  return [_hash(f'{c}|{k}') for c, k in zip(classes, keys)]


class _Canonicalizer:
  """Canonical forms of one module's functions (memoised by name)."""

  def __init__(self, functions: dict[str, _Function]):
    self._functions = functions
    self._rendered: dict[str, list[str]] = {}  # canonical function name -> lines
    # (function, operand names, depth) -> (name, argument order, result order)
    self._instances: dict[tuple, tuple[str, list[int], Any]] = {}
    self._first_use: dict[str, dict[str, tuple]] = {}
    # An opaque value -> (its module, the values from outside the module it stands on).
    self._opaque_inputs: dict[str, tuple[str, frozenset[str]]] = {}
    # Values computed from constants alone (no argument, no side effect): not an input an
    # opaque module stands on (`_opaque`), wherever jax located them.
    self._literals: set[str] = set()

  # -- statements and blocks -------------------------------------------------

  def _statement(self, lines: list[str], scope: dict[str, str], depth: int) -> _Statement:
    header = lines[0].strip()
    lhs = _LHS.match(header)
    def_names: list[tuple[str, int | None]] = []
    if lhs:
      for part in lhs.group(1).split(','):
        name, _, count = part.strip().partition(':')
        def_names.append((name, int(count) if count else None))
      header = _PLACEHOLDER + header[lhs.end(1):]
    marker = _OPAQUE.search(lines[-1])
    if marker and def_names:
      body = [header] + lines[1:]
      body[-1] = _OPAQUE.sub('', body[-1])
      return self._opaque(marker.group(1), def_names, body, scope)
    if marker:  # no result to stand for: compared as any operation
      lines = lines[:-1] + [_OPAQUE.sub('', lines[-1])]
      header = _OPAQUE.sub('', header)
    base = _indent_of(lines[0])
    # Structure lines (the header, `cond {`, `} do {`, `^bb0(...)`, closing
    # braces) versus region bodies (everything indented deeper).
    parts: list[tuple[str, Any]] = [('structure', header)]
    for line in lines[1:]:
      stripped = line.strip()
      # A `reducer(...)` or `^bb0(...)` line is this operation's own structure
      # only within one indentation step of it; deeper, it belongs to an
      # operation nested in a region (e.g. a scatter inside a while body).
      own = _indent_of(line) < base + len(_INDENT)
      if _indent_of(line) <= base or (own and stripped.startswith(_STRUCTURE)):
        parts.append(('structure', stripped))
      elif parts[-1][0] == 'region':
        parts[-1][1].append(line)
      else:
        parts.append(('region', [line]))
    out = self._while(parts, scope, depth) if _WHILE.match(header) else None
    if out is None and _CASE.match(header):
      out = self._case(parts, scope, depth)
    if out is None and len(parts) == 1 and _BARRIER.match(header):
      out = self._barrier(header, scope)
    if out is None:
      out = self._generic(parts, scope, depth)
    out, result_order = out
    refs = set()
    for line in lines:
      refs.update(_SSA.findall(line))
    refs -= {name for name, _ in def_names}
    token = _hash('\n'.join(out))
    defs, aliases = [], {}
    for i, (name, count) in enumerate(def_names):
      suffix = f'_{i}' if len(def_names) > 1 else ''
      defs.append((name, f'%v{token}{suffix}' if not suffix else f'%v{_hash(token + suffix)}'))
    side_effect = not def_names or 'has_side_effect = true' in header
    # Names not in scope are bound by the operation's own regions.
    if not side_effect and all(scope[r] in self._literals for r in refs if r in scope):
      self._literals.update(value for _, value in defs)
    if result_order is not None and len(def_names) == 1:
      name = def_names[0][0]
      aliases = {f'{name}#{old}': f'%v{token}#{new}' for old, new in result_order.items()}
    return _Statement(
        lines=out,
        defs=defs,
        refs=refs,
        token=token,
        terminator=not def_names and bool(_TERMINATORS.match(header)),
        side_effect=side_effect,
        aliases=aliases,
    )

  def _opaque(
      self, module: str, def_names: list[tuple[str, int | None]], lines: list[str], scope: dict[str, str]
  ) -> _Statement:
    """An operation of a module left out of the comparison: an opaque value of the module's inputs.

    Its value stands for "what `module` computes, of this type, from these
    values from outside it": the outside values it reads, directly or
    through other operations of the module (which are not printed: only
    what leaves the module is). So how the module computes is not compared,
    but what feeds it is: an operation whose only user is inside the module
    stays live. Two results of one module with the same type and the same
    outside inputs are one value here (e.g. two statistics of one input):
    which of them a user outside reads is not told apart.
    """
    inputs: set[str] = set()
    names: set[str] = set()
    for line in lines:
      for m in _REF.finditer(line):
        if m.group(0) in scope:
          value = scope[m.group(0)]
        elif m.group(1) in scope:
          value = scope[m.group(1)] + (m.group(2) or '')
        else:  # a name bound inside the operation's own regions
          continue
        # `%x#k`: one result of a multi-result operation, keyed by the operation.
        inside = self._opaque_inputs.get(value) or self._opaque_inputs.get(value.split('#', 1)[0])
        if inside is not None and inside[0] == module:
          inputs |= inside[1]
        elif value.split('#', 1)[0] in self._literals:
          # A constant the module reads is how it computes (jax may locate a constant
          # at the jit's root, not in the module using it): neither an input nor kept
          # live by the module; its other users compare it.
          continue
        else:
          inputs.add(value)
        names.add(m.group(1))
    result_type, result_order = _result_type(lines), None
    loop = _WHILE.match(lines[0].strip())
    if loop and len(def_names) == 1:
      result_type, result_order = self._opaque_loop_results(loop, scope, result_type)
    out = [f'{_PLACEHOLDER} = parity.opaque "{module}"({", ".join(sorted(inputs))}){result_type}']
    token = _hash('\n'.join(out))
    aliases = {}
    if len(def_names) == 1:
      defs = [(def_names[0][0], f'%v{token}')]
      if result_order is not None:
        aliases = {f'{def_names[0][0]}#{old}': f'%v{token}#{new}' for old, new in result_order.items()}
    else:  # a value per result
      defs = [(name, f'%v{_hash(f"{token}_{i}")}') for i, (name, _) in enumerate(def_names)]
    for _, value in defs:
      self._opaque_inputs[value] = (module, frozenset(inputs))
    return _Statement(lines=out, defs=defs, refs=names, token=token, terminator=False, side_effect=False,
                      aliases=aliases, opaque_module=module)

  @staticmethod
  def _opaque_loop_results(loop: re.Match, scope: dict[str, str], result_type: str):
    """(result type, old -> new result index) of a loop left out of the comparison, its results
    in a canonical order: each keyed by its type and its initial value, as `_while` keys the
    carried values it reads (a stock layer's scan, `nn.RNN` against `nnx.RNN`, carries the same
    values in another order); where they cannot be read, as they are."""
    bindings, types = _split_top_level(loop.group(2)), _split_top_level(loop.group(3))
    inits = [b.partition('=')[2].strip() for b in bindings]
    if len(bindings) != len(types) or not all(inits):
      return result_type, None
    order, index = _canonical_indices([f'{types[i]}|{_substitute(inits[i], scope)}' for i in range(len(types))])
    return ' : ' + ', '.join(types[i] for i in order), index

  def _generic(self, parts, scope, depth) -> tuple[list[str], dict[int, int] | None]:
    # Values bound by the structure (block arguments, reducer arguments) are
    # named by position, per nesting depth.
    local: dict[str, str] = {}
    for kind, part in parts:
      if kind == 'structure':
        for name in _SSA.findall(part):
          if name != _PLACEHOLDER and name not in scope and name not in local:
            local[name] = f'%b{depth}_{len(local)}'
    inner_scope = {**scope, **local}
    out: list[str] = []
    for kind, part in parts:
      if kind == 'structure':
        out.append(_substitute(part, inner_scope))
      else:
        out.extend(_INDENT + l for l in self._block(part, inner_scope, depth + 1))
    result_order = None
    call = _CALL_LINE.match(out[0])
    if call and call.group(3) in self._functions:
      out[0], result_order = self._call(call, depth)
    return out, result_order

  def _call(self, call: re.Match, depth: int) -> tuple[str, dict[int, int] | None]:
    """A call of a private function: the callee is read with its arguments
    named by what the caller passes, so neither the order of its arguments
    nor of its results matters (jax orders, e.g., a rematerialised layer's
    residuals as it collects them, differently per side)."""
    lhs, keyword, callee = call.group(1) or '', call.group(2), call.group(3)
    operands, types = _split_top_level(call.group(4)), _split_top_level(call.group(5))
    results = call.group(6)
    name, arg_order, result_order = self._instance(callee, operands, depth)
    if len(types) == len(operands):
      types = [types[i] for i in arg_order]
    operands = [operands[i] for i in arg_order]
    new_index = None
    if result_order is not None:
      order, new_index = result_order
      wrapped = results.startswith('(') and results.endswith(')')
      entries = _split_top_level(results[1:-1] if wrapped else results)
      if len(entries) == len(order):
        joined = ', '.join(entries[i] for i in order)
        results = f'({joined})' if wrapped else joined
      else:
        new_index = None
    line = f'{lhs}{keyword} {name}({", ".join(operands)}) : ({", ".join(types)}) -> {results}'
    return line, new_index

  def _barrier(self, header: str, scope: dict[str, str]) -> tuple[list[str], dict[int, int]] | None:
    """An optimization barrier with its operands (and so its results) in a canonical order.

    Rematerialisation puts the values it saves behind one barrier, in the order
    its implementation collects them: Linen's `nn.remat` and `jax.checkpoint`
    over NNX state pass the same operands in another order. Each operand is
    keyed by its type and its value; results follow their operands.
    """
    m = _BARRIER.match(header)
    operands = [_substitute(o.strip(), scope) for o in _split_top_level(m.group(2))]
    types = _split_top_level(m.group(3))
    if len(operands) != len(types):
      return None
    order, _ = _canonical_indices([f'{types[i]}|{operands[i]}' for i in range(len(operands))])
    position = {old: new for new, old in enumerate(order)}
    out = (f'{m.group(1)} = stablehlo.optimization_barrier {", ".join(operands[i] for i in order)}'
           f' : {", ".join(types[i] for i in order)}')
    return [out], position

  def _while(self, parts, scope, depth) -> tuple[list[str], dict[int, int]] | None:
    """A while loop with its loop-carried values in a canonical order.

    jax orders a scan's carried values as it collects them (e.g. the
    residuals a layer saves for the backward pass), and two spellings of one
    model collect them in different orders (Linen's `nn.scan` against a
    `jax.lax.scan` over `nnx.split` state). Every loop's carried values are
    numbered in the order of their classes (`_carry_classes`): what a carried
    value is, not where it sits.
    """
    m = _WHILE.match(parts[0][1])
    regions = [p for kind, p in parts if kind == 'region']
    bindings, types = _split_top_level(m.group(2)), _split_top_level(m.group(3))
    if len(regions) != 2 or len(bindings) != len(types):
      return None
    names, inits = [], []
    for binding in bindings:
      name, sep, init = binding.partition('=')
      if not sep:
        return None
      names.append(name.strip())
      inits.append(_substitute(init.strip(), scope))
    keys = self._carry_classes(regions, scope, names, types, inits, depth)
    if keys is None:
      return None
    # Values with one key are one value (`_carry_classes`): named, and their results read, alike.
    order, one = _canonical_indices(keys)
    local = {names[i]: f'%b{depth}_{one[i]}' for i in range(len(names))}
    inner_scope = {**scope, **local}
    header = (
        f'{m.group(1)} = stablehlo.while('
        f'{", ".join(f"{local[names[i]]} = {inits[i]}" for i in order)})'
        f' : {", ".join(types[i] for i in order)}'
    )
    out, region_index = [header], 0
    for kind, part in parts[1:]:
      if kind == 'structure':
        out.append(_substitute(part, inner_scope))
        continue
      block = self._block(part, inner_scope, depth + 1)
      if region_index == 1:
        permuted = _permute_return(block[-1], order)
        if permuted is None:
          return None
        block[-1] = permuted
      out.extend(_INDENT + l for l in block)
      region_index += 1
    return out, one

  def _loop_body(self, regions, scope, names, labels, depth) -> list[str]:
    """A loop's body read with each carried value named by its label."""
    return self._block(regions[1], {**scope, **dict(zip(names, labels))}, depth + 1)

  def _carry_classes(self, regions, scope, names, types, inits, depth) -> list[str] | None:
    """Each carried value's sort key: its type, initial value and what the body returns for it,
    refined until values with one key hold one value (None where the loop cannot be read).

    The body is read with the carried values named by class, not position, so
    the keys do not depend on the carried order. The values of one type and
    initial value start as one class (taken to be one value) and a class is
    split by what the body returns for its values, read with every value
    named by its class (so `a + c` and `b + d` part once `c` and `d` have),
    until no class splits. Then the values of a class start alike and step
    alike, so they are one value throughout (a scan's constant jax passes
    twice, or two counters from 0 by 1), whichever of them the program reads
    where: they are named alike. The first reading's keys lead, so a loop
    whose values part at once is ordered as by type, initial value and what
    it returns.
    """
    n = len(names)
    classes = [_hash(types[i] + inits[i]) for i in range(n)]
    first = None
    while True:
      labels = [f'%c{depth}_{c}' for c in classes]
      body = self._loop_body(regions, scope, names, labels, depth)
      returned = _return_operands(body[-1]) if body else None
      if returned is None or len(returned) != n:
        return None
      keys = [f'{types[i]}|{inits[i]}|{returned[i]}' for i in range(n)]
      first = first or keys
      refined = _refined(classes, keys)
      shared = collections.Counter(refined)
      # No class split, or only values alone in theirs and classes the body returns as they
      # are (which cannot split: all their keys are one): the next reading would split none.
      moving = {c for c, r, label in zip(classes, returned, labels) if r != label}
      if len(shared) == len(set(classes)) or all(classes[i] not in moving for i in range(n)
                                                 if shared[refined[i]] > 1):
        return [f'{first[i]}|{refined[i]}' for i in range(n)]
      classes = refined

  def _case(self, parts, scope, depth) -> tuple[list[str], dict[int, int]] | None:
    """A conditional (`stablehlo.case`, `stablehlo.if`) with its results in a canonical order.

    `lax.cond` returns its branches' outputs in the pytree order of what they
    return: optax's MultiSteps returns the whole optimizer state so, in each
    side's order of its state's paths. Each result is keyed by its type and
    what every branch returns for it; the branches' returns and the result
    types are then put in key order.
    """
    out, _ = self._generic(parts, scope, depth)
    blocks, current = [], None
    for index, line in enumerate(out[1:], 1):
      if line.startswith(_INDENT):
        if current is None:
          current = []
          blocks.append(current)
        current.append(index)
      else:
        current = None
    m = _RESULT_TYPES.match(out[-1])
    if not blocks or m is None:
      return None
    types = _split_top_level(m.group(2))
    returns = [_return_operands(out[block[-1]]) for block in blocks]
    if any(r is None or len(r) != len(types) for r in returns):
      return None
    order, _ = _canonical_indices(['|'.join([types[i]] + [r[i] for r in returns]) for i in range(len(types))])
    for block in blocks:
      permuted = _permute_return(out[block[-1]], order)
      if permuted is None:
        return None
      out[block[-1]] = permuted
    out[-1] = f'{m.group(1)}({", ".join(types[i] for i in order)})'
    return out, {old: new for new, old in enumerate(order)}

  def _block(self, lines: list[str], scope: dict[str, str], depth: int) -> list[str]:
    """A block's canonical lines: live statements, once each, in canonical order."""
    scope = dict(scope)
    defined_by: dict[str, int] = {}
    statements: list[_Statement] = []
    deps: list[set[int]] = []
    owner: dict[str, int] = {}  # value token -> defining statement
    transposes: dict[str, tuple[str, list[int]]] = {}  # token -> (operand, permutation)
    # SSA name of an opaque value -> (module, the SSA names from outside the
    # module it stands on): the module's own operations are not printed, what
    # feeds them stays live.
    opaque_refs: dict[str, tuple[str, frozenset[str]]] = {}
    for stmt_lines in _split_statements(lines):
      stmt = self._statement(stmt_lines, scope, depth)
      if stmt.opaque_module is not None:
        refs = set()
        for n in stmt.refs:
          inside = opaque_refs.get(n)
          refs |= inside[1] if inside is not None and inside[0] == stmt.opaque_module else {n}
        stmt = dataclasses.replace(stmt, refs=refs)
        for name, _ in stmt.defs:
          opaque_refs[name] = (stmt.opaque_module, frozenset(refs))
      transpose = _TRANSPOSE.match(stmt.lines[0])
      if transpose:
        operand, perm = transpose.group(1), [int(d) for d in transpose.group(2).split(',')]
        inner = transposes.get(operand)
        if inner is not None and [inner[1][d] for d in perm] == list(range(len(perm))):
          # transpose(transpose(x)) == x: the value is x (XLA folds it too).
          name = stmt.defs[0][0]
          scope[name] = inner[0]
          if inner[0] in owner:
            defined_by[name] = owner[inner[0]]
          else:
            defined_by.pop(name, None)
          deps.append(set())
          statements.append(dataclasses.replace(stmt, side_effect=False))
          continue
        transposes[stmt.defs[0][1]] = (operand, perm)
      deps.append({defined_by[n] for n in stmt.refs if n in defined_by})
      for name, token in stmt.defs:
        scope[name] = token
        defined_by[name] = len(statements)
        owner[token] = len(statements)
      scope.update(stmt.aliases)
      statements.append(stmt)
    # Dead code: only what a terminator or a side effect needs stays.
    live, stack = set(), [i for i, s in enumerate(statements) if s.side_effect]
    while stack:
      i = stack.pop()
      if i not in live:
        live.add(i)
        stack.extend(deps[i])
    # Identical statements are one; order: topological, ready ones by token,
    # terminators last.
    by_token: dict[str, int] = {}
    for i in sorted(live):
      by_token.setdefault(statements[i].token, i)
    token_deps = {
        t: {statements[d].token for d in deps[i]} - {t} for t, i in by_token.items()
    }
    users: dict[str, set[str]] = collections.defaultdict(set)
    for t, ds in token_deps.items():
      for d in ds:
        users[d].add(t)
    waiting = {t: len(ds) for t, ds in token_deps.items()}
    key = lambda t: (statements[by_token[t]].terminator, t)
    ready = [key(t) for t, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
      _, t = heapq.heappop(ready)
      stmt = statements[by_token[t]]
      out.extend(self._with_results(stmt))
      for u in users[t]:
        waiting[u] -= 1
        if waiting[u] == 0:
          heapq.heappush(ready, key(u))
    return out

  @staticmethod
  def _with_results(stmt: _Statement) -> list[str]:
    if not stmt.defs:
      return stmt.lines
    results = ', '.join(token for _, token in stmt.defs)
    header = stmt.lines[0]
    count = re.match(r'%_(:\d+)?', header).group(1) or ''
    return [results + count + header[len(_PLACEHOLDER) + len(count):]] + stmt.lines[1:]

  # -- functions -------------------------------------------------------------

  def _instance(self, callee: str, operands: list[str], depth: int):
    """The private function `callee` with its arguments named `operands`.

    Returns its canonical name (the hash of its signature and body), the
    order of its arguments (by name) and of its results (by value name).
    """
    key = (callee, tuple(operands), depth)
    if key not in self._instances:
      fn = self._functions[callee]
      if len(fn.args) != len(operands):
        operands = [f'%a{i}' for i in range(len(fn.args))]
      scope = {arg: operands[i] for i, (arg, _) in enumerate(fn.args)}
      body = [_INDENT + l for l in self._block(fn.body, scope, depth)]
      body, results, result_order = _sort_results(body, fn.results)
      arg_order = sorted(range(len(fn.args)), key=lambda i: (operands[i], fn.args[i][1], i))
      # One value passed at several positions is read once: the body names each by the value,
      # so a function given `x` twice reads as one given it once (a jit boundary that passes
      # one value twice, as one it takes as the same state by two paths, is the same program).
      seen: set[tuple[str, str]] = set()
      arg_order = [i for i in arg_order if not ((operands[i], fn.args[i][1]) in seen
                                               or seen.add((operands[i], fn.args[i][1])))]
      args = ', '.join(f'{operands[i]}: {fn.args[i][1]}' for i in arg_order)
      arrow = f' -> {results}' if results else ''
      signature = f'func.func private {{name}}({args}){arrow} {{'
      name = f'@f{_hash(signature + chr(10) + chr(10).join(body))}'
      self._rendered[name] = [signature.replace('{name}', name)] + body + ['}']
      self._instances[key] = (name, arg_order, result_order)
    return self._instances[key]

  def _first_uses(self, fn_name: str) -> dict[str, tuple]:
    """Where each value of a function is first used, looking into calls.

    The key is (line, column) of the first use, or, when that use is as an
    argument of a private function, (line, -1, where the callee first uses
    that argument): a jitted function under a mesh wraps the whole step in
    a call, and the order that matters is the order of use inside it.
    """
    if fn_name in self._first_use:
      return self._first_use[fn_name]
    fn = self._functions[fn_name]
    self._first_use[fn_name] = found = {}
    for index, line in enumerate(fn.body):
      for m in _SSA.finditer(line):
        name = m.group(0)
        if name in found:
          continue
        call = _CALL_OPERANDS.search(line)
        if call and call.group(1) in self._functions and m.start() > call.start():
          operands = [o.split('#')[0] for o in _split_top_level(call.group(2))]
          callee = self._functions[call.group(1)]
          if name in operands and len(operands) == len(callee.args):
            param = callee.args[operands.index(name)][0]
            inner = self._first_uses(call.group(1)).get(param, (len(callee.body),))
            found[name] = (index, -1, inner)
            continue
        found[name] = (index, m.start(), ())
    return found

  def _main(self, arg_names: list[str] | None) -> None:
    fn = self._functions['@main']
    # Pytree flattening orders the arguments differently per side (a Linen
    # TrainState flattens `step` first): named by their state path when the
    # caller knows it, else numbered by first use.
    if arg_names is not None:
      if len(arg_names) != len(fn.args):
        raise ValueError(f'{len(arg_names)} argument names for {len(fn.args)} arguments of @main')
      names = [_arg_name(n) for n in arg_names]
      if len(set(names)) != len(names):
        raise ValueError(f'argument names are not unique: {sorted(arg_names)}')
      order = sorted(range(len(fn.args)), key=lambda i: names[i])
    else:
      uses = self._first_uses('@main')
      unused = (len(fn.body), 0, ())
      order = sorted(range(len(fn.args)), key=lambda i: (uses.get(fn.args[i][0], unused), i))
      names = [''] * len(fn.args)
      for rank, i in enumerate(order):
        names[i] = f'%a{rank}'
    scope = {fn.args[i][0]: names[i] for i in order}
    args = ', '.join(f'{names[i]}: {fn.args[i][1]}' for i in order)
    body = [_INDENT + l for l in self._block(fn.body, scope, 0)]
    body, results, _ = _sort_results(body, fn.results)
    vis = f'{fn.visibility} ' if fn.visibility else ''
    arrow = f' -> {results}' if results else ''
    self._rendered['@main'] = [f'func.func {vis}@main({args}){arrow} {{'] + body + ['}']

  def render(self, others: list[str], arg_names: list[str] | None = None) -> str:
    """The module: non-function lines, @main, then every function it reaches."""
    if '@main' in self._functions:
      self._main(arg_names)
    out = [re.sub(r'^(\s*module\s+)@[\w$.-]+', r'\1@m', l.strip()) for l in others]
    closing = out.pop() if out and out[-1] == '}' else None
    seen, queue = set(), ['@main'] if '@main' in self._rendered else []
    while queue:
      name = queue.pop(0)
      if name in seen:
        continue
      seen.add(name)
      lines = self._rendered[name]
      out.extend(_INDENT + l for l in lines)
      for line in lines[1:]:
        queue.extend(f for f in _FUNC_TOKEN.findall(line) if f not in seen)
    if closing:
      out.append(closing)
    return '\n'.join(l.rstrip() for l in out if l.strip()) + '\n'


def _sort_results(
    body: list[str], results: str
) -> tuple[list[str], str, tuple[list[int], dict[int, int]] | None]:
  """A function's results ordered by their value names.

  The order of @main's results is the pytree order (which differs per
  side); a private function's is the order jax collected them in (e.g. the
  residuals of a rematerialised layer). Returns the body, the result types,
  and (order, old index -> new index) for the call sites.
  """
  index = len(body) - 1
  while index >= 0 and not _RETURN.match(body[index].strip()):
    index -= 1
  if index < 0:
    return body, results, None
  operands = _return_operands(body[index])
  wrapped = results.startswith('(') and results.endswith(')')
  entries = _split_top_level(results[1:-1] if wrapped else results)
  if len(entries) != len(operands):
    return body, results, None
  order, new_index = _canonical_indices([f'{operands[i]}|{entries[i]}' for i in range(len(entries))])
  permuted = _permute_return(body[index], order)
  if permuted is None:
    return body, results, None
  body = list(body)
  body[index] = permuted
  joined = ', '.join(entries[i] for i in order)
  return body, f'({joined})' if wrapped else joined, (order, new_index)


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


def canonicalize(
    text: str, arg_names: list[str] | None = None, opaque_modules: tuple[str, ...] = ()
) -> str:
  """The lowered (StableHLO) text as a canonical dataflow graph (see above).

  Removed: debug locations, `jax.result_info`/`jax.arg_info` labels, the
  module name, SSA value names (values are named by the hash of their
  computation), private function names (named by the hash of their body,
  read per call), the order of independent operations, of a function's
  arguments and results and of a loop's carried values, dead operations,
  repeated identical operations, transposes that undo each other, and the
  pytree order of @main's arguments and results (sorted by name). With
  `arg_names` (one per argument of @main, e.g. each state leaf's checkpoint
  path) the arguments take those names; without, they are numbered by first
  use. Kept: every live operation, type, shape, attribute, sharding and
  constant.

  `opaque_modules` (module paths, e.g. `layers_0/LayerNorm_0`; needs the text
  with debug locations, and an NNX side lowered with its modules named, see
  parity/compare/scopes.py): every operation located inside one of them becomes an
  opaque value, `parity.opaque "<module>"(<inputs>) : <type>`, keyed by the
  module, its result type and the values from outside the module it depends
  on; the module's own operations are not printed. The values the module
  passes to the rest of the program are then the same on both sides however
  it computes them, what feeds the module is still compared, and the rest
  must match. (An operation outside the module whose region, a loop body or
  a called function, uses a value computed inside it keeps that value's
  computation: where the two sides place a module's operations across such
  a boundary differently, they differ.)
  """
  if opaque_modules:
    text = _mark_opaque(text, tuple(opaque_modules))
  text = _strip_label_attrs(_strip_locations(text))
  items = _parse_functions(text)
  functions = {i.name: i for i in items if isinstance(i, _Function)}
  others = [i for i in items if isinstance(i, str)]
  return _Canonicalizer(functions).render(others, arg_names)


def _short_names(texts: list[str], minimum: int = 6) -> list[str]:
  """Hash names cut to the shortest prefix that keeps them apart (for reading)."""
  names = set()
  for text in texts:
    names.update(_VALUE_TOKEN.findall(text))
    names.update(_FUNC_TOKEN.findall(text))
  length = minimum
  while length < _TOKEN_HEX and len({n[:2 + length] for n in names}) < len(names):
    length += 2
  cut = lambda m: m.group(0)[:2 + length]
  return [_FUNC_TOKEN.sub(cut, _VALUE_TOKEN.sub(cut, t)) for t in texts]


# ---------------------------------------------------------------------------
# Diff
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AllowedDifference:
  """A difference between the sides inherent to the frameworks, removed before comparing.

  Each one is removed by one exact change to what is traced (never a
  pattern over the program text), so everything else still has to match.
  """

  name: str
  reason: str
  nnx_dtype: Any = None


STEP_COUNTER_DTYPE = AllowedDifference(
    name='step counter dtype',
    reason=(
        "Linen's TrainState counts steps in int32 and nnx.Optimizer in uint32 (the bridge"
        " converts the value exactly). The Linen step is compared as traced with a uint32"
        ' counter: its own code, the counter\'s dtype the only change.'
    ),
    nnx_dtype=np.uint32,
)

# Every difference the program comparison allows, with its reason.
ALLOWED: tuple[AllowedDifference, ...] = (STEP_COUNTER_DTYPE,)


_WHILE_TYPES = re.compile(r'stablehlo\.while\((?:[^()]|\([^()]*\))*\)\s*:\s*([^\n]*)')


def loop_carries(text: str, opaque_modules: tuple[str, ...] = ()) -> list[list[str]]:
  """Each `stablehlo.while` of a lowered program, in text order: the types it carries, in order.

  Types, not values: two carried values of one type trading places are not
  told apart here (the canonical comparison still sees what each computes).
  A loop located in one of `opaque_modules` (needs the text with debug
  locations) is left out: how such a module computes is not compared.
  """
  if opaque_modules:
    text = _without_loops_in(text, opaque_modules)
  text = _strip_locations(text)
  return [_split_top_level(m.group(1).strip()) for m in _WHILE_TYPES.finditer(text)]


def _without_loops_in(text: str, modules: tuple[str, ...]) -> str:
  """`text` without the headers of the loops located in one of `modules` (a loop's location is
  on the line closing it)."""
  lines = _mark_opaque(text, modules).splitlines()
  out = list(lines)
  for i, line in enumerate(lines):
    if 'stablehlo.while(' not in line:
      continue
    indent = _indent_of(line)
    end = next((k for k in range(i + 1, len(lines)) if _indent_of(lines[k]) == indent
                and lines[k].strip().startswith('}') and not lines[k].strip().startswith('} do')), None)
    if end is not None and '\u27e6opaque' in lines[end]:
      out[i] = ''
  return '\n'.join(out)


def _unpaired_loops(a: list[list[str]], b: list[list[str]]):
  """The loops (index, carried types) of each side left when each loop is paired with one of
  the other side's carrying the same sequence of types, first come first paired."""
  left_b = list(enumerate(b))
  left_a = []
  for k, x in enumerate(a):
    j = next((j for j, (_, y) in enumerate(left_b) if y == x), None)
    if j is None:
      left_a.append((k, x))
    else:
      del left_b[j]
  return left_a, left_b


def loop_order_difference(
    linen_text: str, nnx_text: str, reorder_only: bool = False, opaque_modules: tuple[str, ...] = ()
) -> str:
  """'' when both programs' loops carry the same types in the same order; else where they differ.

  Not a difference of programs (`diff` reads every loop's carried order
  away): a note of what XLA schedules from. `reorder_only`: only a loop
  carrying the same values in another order is reported.

  Loops are paired by what they carry, not by their place in the text: the
  two sides may print their private functions, and so their loops, in
  another order. A Linen loop with no NNX loop carrying the same sequence is
  reported, against an unpaired NNX loop carrying the same types in another
  order if there is one.
  """
  a, b = loop_carries(linen_text, opaque_modules), loop_carries(nnx_text, opaque_modules)
  if len(a) != len(b):
    return '' if reorder_only else f'Linen has {len(a)} loops, NNX {len(b)}'
  unpaired_linen, unpaired_nnx = _unpaired_loops(a, b)
  if not unpaired_linen:
    return ''
  k, x = unpaired_linen[0]
  same_types = [(m, y) for m, y in unpaired_nnx if sorted(y) == sorted(x)]
  if not same_types:
    return '' if reorder_only else f'loop {k} (of {len(a)}, in program order) carries other types'
  m, y = same_types[0]
  where = (
      f'loop {k} (of {len(a)}, in program order) carries' if m == k
      else f"Linen's loop {k} and NNX's loop {m} (of {len(a)}, in program order) carry"
  )
  i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
  return (
      f'{where} the same {len(x)} values in another'
      f' order, from value {i} on: Linen {", ".join(x[i:i + 3])}, ...; NNX'
      f' {", ".join(y[i:i + 3])}, ... (e.g. nnx.scan flattens a module\'s state by path,'
      " while Linen's nn.scan takes one collection after another: in an nnx.scan of your"
      " own, nnx.StateAxes orders them as Linen does; under remat, Linen's collections enter"
      " in name order: split the NNX state by filters in that order. flax's own loops, as"
      " nnx.RNN's beside nn.RNN's, keep their order)"
  )


_MAIN_SIGNATURE = re.compile(r'\s*func\.func public @main\(')
_MAIN_ARGUMENT = re.compile(r'%arg(\d+): (tensor<[^>]*>)')


def _parameter_types(text: str, names: list[str] | None) -> list[str]:
  """The types of the program's parameter arguments (`params/...` by name)."""
  if names is None:
    return []
  main = re.search(r'func\.func public @main\((.*?)\)\s*->', text, re.S)
  if main is None:
    return []
  return [t for k, t in _MAIN_ARGUMENT.findall(main.group(1))
          if int(k) < len(names) and names[int(k)].startswith('params/')]


def loop_carry_growth(
    linen_text: str, nnx_text: str, linen_args: list[str] | None = None, nnx_args: list[str] | None = None
) -> str:
  """'' unless a loop of one side carries what its counterpart carries and more; else which, and what.

  Loops carrying the same sequence of types pair first; a loop left is
  paired with one of the other side's left whose carried types include all
  of its own. Where the values only NNX carries each have a parameter's type
  (`params/...` arguments, by the names given), the usual cause is named: a
  module's state coming back out of a transformed call (`nnx.remat` over a
  module returns it, and a scan then carries it through the loop).
  """
  a, b = loop_carries(linen_text), loop_carries(nnx_text)
  left_a, left_b = _unpaired_loops(a, b)

  def extra(big: list[str], small: list[str]) -> list[str] | None:
    counts = collections.Counter(big)
    counts.subtract(small)
    if len(big) <= len(small) or any(v < 0 for v in counts.values()):
      return None
    return list(counts.elements())

  for k, x in left_a:
    for m, y in left_b:
      for more, fewer, what, (i, j), side_text, side_args in (
          ('NNX', 'Linen', extra(y, x), (m, k), nnx_text, nnx_args),
          ('Linen', 'NNX', extra(x, y), (k, m), linen_text, linen_args),
      ):
        if what is None:
          continue
        shown = ', '.join(what[:4]) + (', ...' if len(what) > 4 else '')
        line = (f"{more}'s loop {i} carries {len(what)} values more than {fewer}'s loop {j}"
                f' (of {len(a)}, in program order): {shown}')
        params = collections.Counter(_parameter_types(side_text, side_args))
        if more == 'NNX' and params and not collections.Counter(what) - params:
          line += (', each of a parameter\'s type: a module\'s state coming back out of a transformed'
                   ' call, as `nnx.remat` over a module returns it; `jax.checkpoint` over the state'
                   ' `nnx.split` gives, merged inside, takes it in only, as Linen\'s `nn.remat` does')
        return line
  return ''


@dataclasses.dataclass
class ProgramDiff:
  identical: bool
  # 1-based line in the canonical Linen program; None when identical.
  first_difference: int | None
  linen_lines: int
  nnx_lines: int
  changed_lines: int  # lines removed plus lines added
  diff: str  # a short unified diff of the canonical programs, '' when identical
  first_linen: str = ''  # the first differing canonical line, each side
  first_nnx: str = ''
  allowed: list[str] = dataclasses.field(default_factory=list)  # names of ALLOWED entries applied
  # Where the programs part (`_parting`): each side's first operations (up to 3) of
  # values only it computes, from operands both compute; [] when identical.
  parting_linen: list[str] = dataclasses.field(default_factory=list)
  parting_nnx: list[str] = dataclasses.field(default_factory=list)
  # A note, not a difference: where the canonical programs are identical, a loop carrying the
  # same values in another order (`loop_order_difference`). The same program; XLA schedules
  # from the carried order, and where that changes memory, the memory part measures it.
  loop_order: str = ''
  # Arguments (by name) of one program only: state one side has and the other has not,
  # or an input one side never reads (jit drops it).
  arguments_only_linen: list[str] = dataclasses.field(default_factory=list)
  arguments_only_nnx: list[str] = dataclasses.field(default_factory=list)
  # Where they differ: a loop carrying its counterpart's values and more (`loop_carry_growth`).
  loop_growth: str = ''
  # Of every operation where the programs part (`_parting`, all of them, `Linen: ...` / `NNX: ...`):
  # those that change values (`value_changes`: a constant, an operation other than a reshape
  # of a value the other side reshapes alike), and the reshapes both sides make of one value
  # to one type, otherwise spelt (`reshapes`: the same numbers). [] when identical.
  value_changes: list[str] = dataclasses.field(default_factory=list)
  reshapes: list[str] = dataclasses.field(default_factory=list)

  def summary(self, loop_growth: bool = True) -> str:
    """One line; `loop_growth=False` leaves out `loop_growth`, for a second summary beside one that has it."""
    if self.identical:
      except_ = f' except: {", ".join(self.allowed)}' if self.allowed else ''
      return f'programs identical{except_} ({self.linen_lines} canonical lines)'
    return (
        f'programs differ: first difference at canonical line {self.first_difference}'
        f' of {self.linen_lines} (Linen) / {self.nnx_lines} (NNX); {self.changed_lines}'
        ' lines changed'
        + (f'; {self.loop_growth}' if self.loop_growth and loop_growth else '')
        + one_sided_arguments(self.arguments_only_linen, self.arguments_only_nnx)
    )

  def parting_lines(self) -> list[str]:
    """Where the programs part (`_parting`), a line per operation."""
    return [f'where they part, {side}: {op}'
            for side, ops in (('Linen', self.parting_linen), ('NNX', self.parting_nnx)) for op in ops]

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _clip(line: str, width: int, start: int = 0) -> str:
  """`line` cut to `width` characters, showing the part from about `start` on."""
  if len(line) <= width:
    return line
  lead = 0 if start < width // 2 else min(start - width // 4, len(line) - width + 3)
  text = line[lead:lead + width - 6]
  return ('...' if lead else '') + text + ('...' if lead + width - 6 < len(line) else '')


def _first_difference(a: str, b: str) -> int:
  return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


_CALL = re.compile(r'\bcall @')  # `call @f...` and `func.call @f...`


def _parting(a: list[str], b: list[str], most: int = 3) -> tuple[list[int], list[int]]:
  """Where two canonical programs part: on each side, the operations defining values only
  it has from operands both have (arguments, block arguments, values both compute).

  Every other differing operation depends on one of these. The first differing
  line does not tell them apart: statements ready at once are ordered by their
  hashes, so it may be any operation that differs. A changed constant is one
  (it has no operands); an operation added on one side makes its users on
  the other read one value otherwise, so those show too. At most `most` per
  side, in canonical order, calls last; their line indices (names whole, as canonicalize writes them).
  """
  def defined(lines):
    out = []
    for line in lines:
      lhs, sep, rhs = line.partition(' = ')
      names = _VALUE_TOKEN.findall(lhs) if sep and lhs.lstrip().startswith('%') else []
      out.append((names, _VALUE_TOKEN.findall(rhs) if names else []))
    return out

  ours_a, ours_b = defined(a), defined(b)
  values_a = {n for names, _ in ours_a for n in names}
  values_b = {n for names, _ in ours_b for n in names}
  shared = values_a & values_b

  def first(lines, ours, other):
    found = [i for i, (names, operands) in enumerate(ours)
             if names and not set(names) & other and set(operands) <= shared]
    # A call of a function that differs is where they part only because of what the
    # function does inside, whose own parting operations are found too: those first.
    return sorted(found, key=lambda i: _CALL.search(lines[i]) is not None)[:most]

  return first(a, ours_a, values_b), first(b, ours_b, values_a)


def _clip_diff(lines: list[str], width: int) -> list[str]:
  """Unified-diff lines cut to `width`; a changed line pair is cut around its difference (the
  last removed lines of a run beside as many added ones; the rest, each on its own)."""
  out, i = [], 0
  while i < len(lines):
    minus = i
    while minus < len(lines) and lines[minus].startswith('-') and not lines[minus].startswith('---'):
      minus += 1
    plus = minus
    while plus < len(lines) and lines[plus].startswith('+') and not lines[plus].startswith('+++'):
      plus += 1
    if plus == i:  # context, or a file header
      out.append(_clip(lines[i], width))
      i += 1
      continue
    paired = plus - minus if minus - i >= plus - minus else 0  # as many removed lines as added
    out += [_clip(line, width) for line in lines[i:minus - paired]]
    removed, added = lines[minus - paired:minus], lines[minus:plus] if paired else []
    starts = [_first_difference(r[1:], a[1:]) for r, a in zip(removed, added)]
    out += [r[0] + _clip(r[1:], width - 1, k) for r, k in zip(removed, starts)]
    out += [a[0] + _clip(a[1:], width - 1, k) for a, k in zip(added, starts)]
    out += [] if paired else [_clip(line, width) for line in lines[minus:plus]]
    i = plus
  return out


def diff(
    linen_text: str,
    nnx_text: str,
    context: int = 1,
    max_lines: int = 40,
    width: int = 160,
    linen_args: list[str] | None = None,
    nnx_args: list[str] | None = None,
    allowed: tuple[AllowedDifference, ...] = (),
    opaque_modules: tuple[str, ...] = (),
) -> ProgramDiff:
  """Canonicalises both programs and compares them line by line.

  The diff shows at most `max_lines` lines, each cut to `width` characters
  (a changed line around where it changes); hash names are shortened for
  reading (the comparison uses them whole).
  """
  full = [
      canonicalize(linen_text, linen_args, opaque_modules),
      canonicalize(nnx_text, nnx_args, opaque_modules),
  ]
  allowed_names = [a.name for a in allowed]
  if full[0] == full[1]:
    n = len(full[0].splitlines())
    # Loops carrying the same values in another order are the same program (the canonical
    # form orders every loop's carried values by what they are): noted, not a difference.
    loop_order = loop_order_difference(linen_text, nnx_text, reorder_only=True, opaque_modules=opaque_modules)
    return ProgramDiff(True, None, n, n, 0, '', allowed=allowed_names, loop_order=loop_order)
  a, b = (t.splitlines() for t in _short_names(full))
  matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
  opcodes = [op for op in matcher.get_opcodes() if op[0] != 'equal']
  # @main's signature lists its results in the canonical order of their values, so it
  # differs wherever anything does: the first difference shown is the first in a body.
  _, i1, i2, j1, j2 = next(
      (op for op in opcodes if not all(_MAIN_SIGNATURE.match(x) for x in a[op[1]:op[2]] + b[op[3]:op[4]])),
      opcodes[0])
  changed = sum((i2_ - i1_) + (j2_ - j1_) for _, i1_, i2_, j1_, j2_ in opcodes)
  lines = _clip_diff(list(difflib.unified_diff(a, b, 'linen', 'nnx', n=context, lineterm='')), width)
  if len(lines) > max_lines:
    lines = lines[:max_lines] + [f'... ({len(lines) - max_lines} more diff lines)']
  first_a = a[i1].strip() if i1 < i2 else ''
  first_b = b[j1].strip() if j1 < j2 else ''
  start = _first_difference(first_a, first_b)
  every = _parting(full[0].splitlines(), full[1].splitlines(), most=len(a) + len(b))
  parting = tuple(found[:3] for found in every)  # the same as most=3: the order is kept
  changes, reshapes = _value_changes([a[i].strip() for i in every[0]], [b[i].strip() for i in every[1]], width)
  return ProgramDiff(
      False, i1 + 1, len(a), len(b), changed, '\n'.join(lines),
      first_linen=_clip(first_a, width, start), first_nnx=_clip(first_b, width, start),
      parting_linen=[_clip(a[i].strip(), width) for i in parting[0]],
      parting_nnx=[_clip(b[i].strip(), width) for i in parting[1]],
      allowed=allowed_names,
      loop_growth=loop_carry_growth(linen_text, nnx_text, linen_args, nnx_args),
      value_changes=changes, reshapes=reshapes,
      **_arguments_only(linen_args, nnx_args),
  )


# An operation that only reshapes a value, moving no element (row-major order kept): a
# reshape, a broadcast_in_dim that adds unit axes only, a transpose that moves unit axes only.
_RESHAPE_LIKE = re.compile(
    r'=\s*stablehlo\.(reshape|broadcast_in_dim|transpose)\s+(%\w+)(?:,\s*dims\s*=\s*\[([\d,\s]*)\])?'
    r'\s*:\s*\((tensor<[^<>]*>)\)\s*->\s*(tensor<[^<>]*>)\s*$')
# Operations that differ because what they run differs (a called function, a loop's or a
# conditional's body), whose own differing operations are found too.
_REGION_OP = re.compile(r'=\s*(?:func\.)?call @|=\s*"?stablehlo\.(?:while|case|if)\b')


def _tensor_type(text: str) -> tuple[tuple[int, ...], str] | None:
  """`tensor<8x1xf32>` as ((8, 1), 'f32'); None where a dimension is not a number."""
  parts = text[len('tensor<'):-1].split(',')[0].strip().split('x')
  if not all(p.isdigit() for p in parts[:-1]):
    return None
  return tuple(int(p) for p in parts[:-1]), parts[-1]


def _reshape_key(line: str) -> tuple[str, str] | None:
  """(operand, result type) of an operation that only reshapes its operand (`_RESHAPE_LIKE`);
  None for any other operation."""
  m = _RESHAPE_LIKE.search(line)
  if m is None:
    return None
  op, operand, dims, source, result = m.groups()
  src, dst = _tensor_type(source), _tensor_type(result)
  if src is None or dst is None or src[1] != dst[1] or int(np.prod(src[0])) != int(np.prod(dst[0])):
    return None
  order = [int(d) for d in dims.split(',')] if dims and dims.strip() else []
  if op == 'broadcast_in_dim' and order != sorted(set(order)):
    return None
  if op == 'transpose' and [d for d in order if src[0][d] != 1] != sorted(d for d in order if src[0][d] != 1):
    return None
  return operand, result


def _value_changes(linen: list[str], nnx: list[str], width: int) -> tuple[list[str], list[str]]:
  """Of the operations where two programs part (each side's, as `_parting` finds them): those
  that change values, and the reshapes of one value to one type that both sides make (the
  same numbers, otherwise spelt); each `Linen: <operation>` or `NNX: <operation>`.

  A constant one side has is a change; so is any operation but a reshape (`_reshape_key`), and
  a reshape the other side does not make of the same value to the same type. Operations that
  differ because what they call or loop over differs are left out: what differs inside is
  found too.
  """
  sides = (('Linen', [l for l in linen if not _REGION_OP.search(l)]),
           ('NNX', [l for l in nnx if not _REGION_OP.search(l)]))
  keys = [{_reshape_key(l) for l in lines} - {None} for _, lines in sides]
  changes, reshapes = [], []
  for (name, lines), other in ((sides[0], keys[1]), (sides[1], keys[0])):
    for line in lines:
      key = _reshape_key(line)
      (reshapes if key is not None and key in other else changes).append(f'{name}: {_clip(line, width)}')
  return changes, reshapes


def _arguments_only(linen_args: list[str] | None, nnx_args: list[str] | None) -> dict[str, list[str]]:
  """The argument names of one program only (none unless both programs' names are known)."""
  if linen_args is None or nnx_args is None:
    return {}
  return {'arguments_only_linen': sorted(set(linen_args) - set(nnx_args)),
          'arguments_only_nnx': sorted(set(nnx_args) - set(linen_args))}


def one_sided_arguments(only_linen, only_nnx) -> str:
  """`'; arguments only in Linen: ...; arguments only in NNX: ...'` for those there are ('' if none)."""
  return ''.join(f'; arguments only in {side}: {", ".join(sorted(names))}'
                 for side, names in (('Linen', only_linen), ('NNX', only_nnx)) if names)


# ---------------------------------------------------------------------------
# Sharding annotations
# ---------------------------------------------------------------------------

# GSPMD: `mhlo.sharding = "{devices=[4,1]<=[4]}"` on arguments and results,
# and `stablehlo.custom_call @Sharding(%x) {mhlo.sharding = "..."}` for a
# constraint. Shardy: `sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}]>`
# on arguments and results, `sdy.sharding_constraint %x <@mesh, [...]>` for a
# constraint, and a per-value `sdy.sharding = #sdy.sharding_per_value<[...]>`
# on other ops.
_GSPMD = re.compile(r'mhlo\.sharding\s*=\s*"((?:[^"\\]|\\.)*)"')
_SDY_ATTR = re.compile(r'sdy\.sharding\s*=\s*#sdy\.sharding(?:_per_value)?<')
_SDY_CONSTRAINT = re.compile(r'sdy\.sharding_constraint\s+%[\w#.$-]+\s*<')


def _angle_block(text: str, open_index: int) -> str:
  """The text between the `<` at open_index and its matching `>`."""
  depth = 0
  for i in range(open_index, len(text)):
    if text[i] == '<':
      depth += 1
    elif text[i] == '>':
      depth -= 1
      if depth == 0:
        return text[open_index + 1:i]
  raise ValueError('unbalanced <...> in a Shardy sharding')


def _normalise(spec: str) -> str:
  return re.sub(r'\s+', ' ', spec.strip())


def sharding_annotations(text: str, mark_signature: bool = False) -> collections.Counter[str]:
  """The multiset of sharding annotations in a lowered program's text.

  Counts argument and result shardings and sharding constraints, in either
  spelling: GSPMD entries as `gspmd:{...}`, Shardy ones as `sdy:<...>` (mesh
  name and dimension shardings). Values are kept verbatim apart from
  whitespace, so two programs with the same shardings, in whatever order,
  give equal counters. Shardy mesh definitions (`sdy.mesh @mesh = <...>`)
  are not annotations and are not counted.

  With `mark_signature`, the shardings of the entry function's arguments and
  results (the state, batch and metrics) are keyed `signature ...`, apart
  from those inside the program (activation constraints and the like).
  """
  text = _strip_locations(text)
  header = re.search(r'^\s*func\.func\s+public\s+@main\(.*$', text, re.MULTILINE)
  in_signature = (lambda i: header.start() <= i < header.end()) if header else (lambda i: False)

  def key(kind: str, index: int) -> str:
    return f'signature {kind}' if mark_signature and in_signature(index) else kind

  found: collections.Counter[str] = collections.Counter()
  for m in _GSPMD.finditer(text):
    found[key(f'gspmd:{_normalise(m.group(1))}', m.start())] += 1
  for pattern in (_SDY_ATTR, _SDY_CONSTRAINT):
    for m in pattern.finditer(text):
      found[key(f'sdy:<{_normalise(_angle_block(text, m.end() - 1))}>', m.start())] += 1
  return found
