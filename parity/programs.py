"""Compare the two sides' train-step programs as text, and read their shardings.

Two lowered programs can spell one computation differently: SSA value names,
private function names (`@_where_41` vs `@_where_40`: jax numbers them as it
traces), debug locations, the `jax.result_info` labels of the pytree paths,
and the order in which the pytree flattening lays out arguments and results
(a Linen `TrainState` flattens `step` first, an NNX state last). None of that
is the computation, so `canonicalize` removes all of it; what is left differs
only where the computation does, and `diff` shows where.

`sharding_annotations` reads the sharding attributes of a lowered program
(GSPMD `mhlo.sharding` and Shardy `sdy.sharding` spellings), so tests can
assert that both sides' programs carry the same shardings.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import re

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


def _rename_values(fn: _Function) -> _Function:
  """Names values `%vN` by first appearance; orders arguments by first use.

  Ordering arguments by first use (and results by the order their values are
  defined) makes the canonical form independent of how a pytree happened to
  be flattened, so two sides whose states flatten differently still compare
  equal when they compute the same thing.
  """
  names: dict[str, str] = {}
  arg_names = {a for a, _ in fn.args}

  def rename(match: re.Match) -> str:
    old = match.group(0)
    if old not in names:
      names[old] = f'%v{len(names)}'
    return names[old]

  body = [_SSA.sub(rename, line) for line in fn.body]
  used_order = {a: int(names[a][2:]) for a in arg_names if a in names}
  unused = [a for a, _ in fn.args if a not in used_order]
  for a in unused:
    names[a] = f'%v{len(names)}'
  order = sorted(fn.args, key=lambda a: int(names[a[0]][2:]))
  args = [(names[a], t) for a, t in order]

  results = fn.results
  if fn.name == '@main' or fn.visibility == 'public':
    body, results = _sort_results(body, results)
  return dataclasses.replace(fn, args=args, results=results, body=body)


def _sort_results(body: list[str], results: str) -> tuple[list[str], str]:
  """Reorders a public function's results by the order their values were defined."""
  for index in range(len(body) - 1, -1, -1):
    m = re.match(r'^(\s*)(func\.)?return\s+(.*?)\s*:\s*(.*)$', body[index])
    if m:
      break
  else:
    return body, results
  indent, prefix, operands, types = m.groups()
  operands, types = _split_top_level(operands), _split_top_level(types)
  inner = results
  wrapped = inner.startswith('(') and inner.endswith(')')
  if wrapped:
    inner = inner[1:-1]
  result_entries = _split_top_level(inner)
  if not (len(operands) == len(types) == len(result_entries)):
    return body, results

  def key(i):
    name = operands[i].split('#')[0]
    return (int(name[2:]) if name[2:].isdigit() else 1 << 30, operands[i])

  order = sorted(range(len(operands)), key=key)
  body = list(body)
  body[index] = (
      f'{indent}{prefix or ""}return {", ".join(operands[i] for i in order)}'
      f' : {", ".join(types[i] for i in order)}'
  )
  joined = ', '.join(result_entries[i] for i in order)
  return body, f'({joined})' if wrapped else joined


def _rename_symbols(items: list) -> list:
  """Names functions `@fN` by first appearance (`@main` kept); the module `@m`."""
  names: dict[str, str] = {'@main': '@main'}

  def rename(match: re.Match) -> str:
    old = match.group(0)
    if old not in names:
      names[old] = f'@f{len(names) - 1}'
    return names[old]

  out = []
  for item in items:
    if isinstance(item, str):
      out.append(re.sub(r'^(\s*module\s+)@[\w$.-]+', r'\1@m', item))
      continue
    name = rename(re.match(_SYMBOL, item.name))
    body = [_SYMBOL_CALL.sub(lambda m: m.group(1) + rename(re.match(_SYMBOL, m.group(2))), l)
            for l in item.body]
    out.append(dataclasses.replace(item, name=name, body=body))
  return out


# Function references in a body: `call @name(`, `func.call @name(`, `callee = @name`.
_SYMBOL_CALL = re.compile(r'((?:call|callee\s*=)\s+)(@[\w$.-]+)')


def _render(items: list) -> str:
  lines = []
  for item in items:
    if isinstance(item, str):
      lines.append(item)
      continue
    args = ', '.join(f'{a}: {t}' for a, t in item.args)
    vis = f'{item.visibility} ' if item.visibility else ''
    results = f' -> {item.results}' if item.results else ''
    lines.append(f'{item.header_indent}func.func {vis}{item.name}({args}){results} {{')
    lines.extend(item.body)
    lines.append(f'{item.header_indent}}}')
  return '\n'.join(line.rstrip() for line in lines if line.strip()) + '\n'


def canonicalize(text: str) -> str:
  """The lowered (StableHLO) text without names, locations and labels.

  Removed: debug locations, `jax.result_info`/`jax.arg_info` labels, the
  module name, private function names (renamed by first appearance), SSA
  value names (renamed by first appearance), and the pytree order of the
  public function's arguments and results (arguments sorted by first use,
  results by definition). Kept: every operation, type, shape, attribute,
  sharding and constant.
  """
  text = _strip_label_attrs(_strip_locations(text))
  items = _parse_functions(text)
  items = [_rename_values(i) if isinstance(i, _Function) else i for i in items]
  items = _rename_symbols(items)
  return _render(items)


# ---------------------------------------------------------------------------
# Diff
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class ProgramDiff:
  identical: bool
  first_difference: int | None  # 1-based line in the canonical Linen program
  linen_lines: int
  nnx_lines: int
  changed_lines: int  # lines removed plus lines added
  diff: str  # a short unified diff, '' when identical

  def summary(self) -> str:
    if self.identical:
      return f'programs identical ({self.linen_lines} canonical lines)'
    return (
        f'programs differ: first difference at canonical line {self.first_difference}'
        f' of {self.linen_lines} (Linen) / {self.nnx_lines} (NNX); {self.changed_lines}'
        ' lines changed'
    )

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def diff(linen_text: str, nnx_text: str, context: int = 2, max_lines: int = 40) -> ProgramDiff:
  """Canonicalises both programs and compares them line by line."""
  a = canonicalize(linen_text).splitlines()
  b = canonicalize(nnx_text).splitlines()
  if a == b:
    return ProgramDiff(True, None, len(a), len(b), 0, '')
  matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
  first = next(i1 for tag, i1, _, _, _ in matcher.get_opcodes() if tag != 'equal')
  changed = sum(
      (i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != 'equal'
  )
  lines = list(difflib.unified_diff(a, b, 'linen', 'nnx', n=context, lineterm=''))
  if len(lines) > max_lines:
    lines = lines[:max_lines] + [f'... ({len(lines) - max_lines} more diff lines)']
  return ProgramDiff(False, first + 1, len(a), len(b), changed, '\n'.join(lines))


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


def sharding_annotations(text: str) -> collections.Counter[str]:
  """The multiset of sharding annotations in a lowered program's text.

  Counts argument and result shardings and sharding constraints, in either
  spelling: GSPMD entries as `gspmd:{...}`, Shardy ones as `sdy:<...>` (mesh
  name and dimension shardings). Values are kept verbatim apart from
  whitespace, so two programs with the same shardings, in whatever order,
  give equal counters. Shardy mesh definitions (`sdy.mesh @mesh = <...>`)
  are not annotations and are not counted.
  """
  text = _strip_locations(text)
  found: collections.Counter[str] = collections.Counter()
  for m in _GSPMD.finditer(text):
    found[f'gspmd:{_normalise(m.group(1))}'] += 1
  for pattern in (_SDY_ATTR, _SDY_CONSTRAINT):
    for m in pattern.finditer(text):
      found[f'sdy:<{_normalise(_angle_block(text, m.end() - 1))}>'] += 1
  return found
