"""Reading lowered StableHLO as text: locations and labels stripped, functions and statements split."""
from __future__ import annotations

import dataclasses
import hashlib
import re


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
