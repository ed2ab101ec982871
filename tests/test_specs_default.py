"""The `default` preset (1.104B parameters) on both sides, by eval_shape only.

The golden `default_specs_fsdp8.txt` is the parameter table of DESIGN.md
(path, dtype, shape, logical axes, physical axes on an fsdp=8 mesh), one
sorted line per parameter; both sides must print exactly it. The goldens for
`fsdp=4,tensor=2` and `data=2,fsdp=2,tensor=2` are the same table on those
meshes, and each side's actual target shardings on a real mesh of the 8 CPU
devices (still eval_shape only) must be the golden physical column.
"""
import pytest

from bridge import specs
from bridge.layout import IDENTITY
from models.config import get_preset
from parity import tables
from parity.sides import make_sides
from tests.golden import check_golden

DEFAULT_PARAM_COUNT = 1_104_218_112


@pytest.fixture(scope='module')
def default_tables():
  linen, nnx_side = make_sides(*get_preset('default'))
  mesh_sizes = specs.parse_mesh_spec('fsdp=8')
  return (
      tables.linen_rows(linen, mesh_sizes=mesh_sizes),
      tables.nnx_rows(nnx_side, mesh_sizes=mesh_sizes),
  )


@pytest.mark.parametrize('side', ['linen', 'nnx'])
def test_default_table_matches_golden(default_tables, side):
  rows = default_tables[0 if side == 'linen' else 1]
  check_golden('default_specs_fsdp8.txt', tables.format_table(rows))


def test_default_sides_print_the_same_table(default_tables):
  linen_rows, nnx_rows = default_tables
  assert tables.format_table(linen_rows) == tables.format_table(nnx_rows)
  assert tables.drift(linen_rows, nnx_rows, layout=IDENTITY) == []


def test_default_param_count(default_tables):
  linen_rows, nnx_rows = default_tables
  assert tables.param_count(linen_rows) == DEFAULT_PARAM_COUNT
  assert tables.param_count(nnx_rows) == DEFAULT_PARAM_COUNT
  assert get_preset('default')[0].param_count() == DEFAULT_PARAM_COUNT


def test_drift_report_names_parameter_and_both_specs(default_tables):
  """The seed's bug: NNX logits_dense logical 'embed' where Linen says 'embed_vocab'."""
  linen_rows, nnx_rows = default_tables
  broken = [dict(r) for r in nnx_rows]
  for r in broken:
    if r['path'].endswith('logits_dense/kernel'):
      r['logical'] = ['embed', 'vocab']
  lines = tables.drift(linen_rows, broken, layout=IDENTITY)
  assert lines == [
      "params/params/decoder/logits_dense/kernel: logical Linen ('embed_vocab','vocab')"
      " vs NNX ('embed','vocab')"
  ]


OTHER_MESHES = {
    'fsdp=4,tensor=2': 'default_specs_fsdp4_tensor2.txt',
    'data=2,fsdp=2,tensor=2': 'default_specs_data2_fsdp2_tensor2.txt',
}


@pytest.mark.parametrize('mesh_spec', sorted(OTHER_MESHES))
def test_default_tables_on_other_meshes_match_goldens(mesh_spec):
  linen, nnx_side = make_sides(*get_preset('default'))
  mesh_sizes = specs.parse_mesh_spec(mesh_spec)
  linen_table = tables.format_table(tables.linen_rows(linen, mesh_sizes=mesh_sizes))
  assert tables.format_table(tables.nnx_rows(nnx_side, mesh_sizes=mesh_sizes)) == linen_table
  check_golden(OTHER_MESHES[mesh_spec], linen_table)


@pytest.mark.parametrize('mesh_spec', ['fsdp=8', *sorted(OTHER_MESHES)])
def test_default_target_shardings_are_the_table(mesh_spec):
  """What the sides place on a real mesh is what the table prints."""
  mesh_sizes = specs.parse_mesh_spec(mesh_spec)
  sides = make_sides(*get_preset('default'), specs.make_mesh(mesh_spec))
  rows = tables.linen_rows(make_sides(*get_preset('default'))[0], mesh_sizes=mesh_sizes)
  for side in sides:
    targets = side.checkpoint_shardings()
    wrong = []
    for row in rows:
      got = [specs._drop_unit_axes(e, mesh_sizes) for e in targets[row['path']].spec]
      got += [None] * (len(row['shape']) - len(got))
      want = [tuple(e) if isinstance(e, list) else e for e in row['physical']]
      if got != want:
        wrong.append(f"{row['path']}: table {want}, {side.name} places {got}")
    assert not wrong, '\n'.join(wrong)
