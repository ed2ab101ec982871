"""The canonical form of a program: a dataflow graph named by what it computes (`canonicalize`)."""
from __future__ import annotations

import collections
import dataclasses
import heapq
import re
from typing import Any

from parity.compare.programs.names import _OPAQUE, _arg_name, _mark_opaque
from parity.compare.programs.text import _BARRIER, _CALL_LINE, _CALL_OPERANDS, _CASE, _FUNC_TOKEN, _Function, _INDENT, _LHS, _PLACEHOLDER, _REF, _RESULT_TYPES, _RETURN, _SSA, _STRUCTURE, _Statement, _TERMINATORS, _TOKEN_HEX, _TRANSPOSE, _VALUE_TOKEN, _WHILE, _canonical_indices, _hash, _indent_of, _parse_functions, _permute_return, _refined, _result_type, _return_operands, _split_statements, _split_top_level, _strip_label_attrs, _strip_locations, _substitute


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
