"""Parameter tables of both sides (path, shape, dtype, logical, physical), via eval_shape only."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import numpy as np

from parity.core import paths
from parity.core import specs
from parity.core.specs import format_names  # noqa: F401  (the tables' and the activation check's format)
from bridge.sides import LinenSide, NnxSide

Row = dict[str, Any]


def _rows(shapes: Mapping[str, Any], logical: Mapping[str, tuple], rules, mesh_sizes) -> list[Row]:
  rows = []
  for path in sorted(shapes):
    names = logical.get(path, ())
    rows.append({
        'path': 'params/params/' + path,
        'shape': [int(d) for d in shapes[path].shape],
        'dtype': np.dtype(shapes[path].dtype).name,
        'logical': list(names),
        'physical': list(specs.physical_spec(names, rules, mesh_sizes)) if mesh_sizes else None,
    })
  return rows


def linen_rows(side: LinenSide, rules=specs.DEFAULT_RULES, mesh_sizes=None) -> list[Row]:
  abstract = side.abstract_variables
  shapes = {p[len('params/'):]: x for p, x in paths.flatten(nn.unbox(abstract)).items()}
  return _rows(shapes, specs.linen_logical_specs(abstract), rules, mesh_sizes)


def nnx_rows(side: NnxSide, rules=specs.DEFAULT_RULES, mesh_sizes=None) -> list[Row]:
  abstract = side.abstract_params
  return _rows(paths.flatten(abstract), specs.nnx_logical_specs(abstract), rules, mesh_sizes)


def placement_mismatches(
    rows: list[Row], shardings: Mapping[str, Any], mesh_sizes: Mapping[str, int]
) -> list[str]:
  """Every row whose actual sharding is not the table's physical column, with both."""
  wrong = []
  for row in rows:
    placed = specs.printed_spec(shardings[row['path']].spec, mesh_sizes, len(row['shape']))
    table = tuple(tuple(e) if isinstance(e, list) else e for e in row['physical'])
    if placed != table:
      wrong.append(f"{row['path']}: table {table}, placed {placed}")
  return wrong


def param_count(rows: list[Row]) -> int:
  return int(sum(int(np.prod(r['shape'])) for r in rows))


def format_row(row: Row) -> str:
  """One golden line: path dtype[shape] logical=(...) physical=(...)."""
  shape = ','.join(str(d) for d in row['shape'])
  line = f"{row['path']} {row['dtype']}[{shape}] logical={format_names(row['logical'])}"
  if row['physical'] is not None:
    line += f" physical={format_names(row['physical'])}"
  return line


def format_table(rows: list[Row]) -> str:
  return ''.join(format_row(r) + '\n' for r in rows)


def drift(linen: list[Row], nnx_: list[Row], layout) -> list[str]:
  """Human lines for every parameter whose shape, dtype or spec differs, layout applied."""
  by_path = {r['path']: r for r in linen}
  nnx_in_linen_layout = {}
  for r in nnx_:
    p = r['path'][len('params/params/'):]
    moved = dict(r)
    moved['shape'] = list(layout.names_to_linen(p, r['shape']))
    moved['logical'] = list(layout.names_to_linen(p, r['logical']))
    if r['physical'] is not None:
      moved['physical'] = list(layout.names_to_linen(p, r['physical']))
    nnx_in_linen_layout[r['path']] = moved
  lines = []
  for path in sorted(set(by_path) | set(nnx_in_linen_layout)):
    a, b = by_path.get(path), nnx_in_linen_layout.get(path)
    if a is None or b is None:
      lines.append(f'{path}: only on {"NNX" if a is None else "Linen"}')
      continue
    for key in ('shape', 'dtype', 'logical', 'physical'):
      if a[key] != b[key]:
        lines.append(f'{path}: {key} Linen {_show(a[key])} vs NNX {_show(b[key])}')
  return lines


def _show(value) -> str:
  if isinstance(value, list) and all(x is None or isinstance(x, (str, list, tuple)) for x in value):
    return format_names(value)
  return str(value)
