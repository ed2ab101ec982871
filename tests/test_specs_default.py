"""The `default` preset (1.104B parameters) on both sides, by eval_shape only.

The golden `default_specs_fsdp8.txt` is the reference decoder's parameter table
(path, dtype, shape, logical axes, physical axes on an fsdp=8 mesh), one
sorted line per parameter; both sides must print exactly it. The goldens for
`fsdp=4,tensor=2` and `data=2,fsdp=2,tensor=2` are the same table on those
meshes, and each side's actual target shardings on a real mesh of the 8 CPU
devices (still eval_shape only) must be the golden physical column.
"""
import functools

import pytest

from parity.core import specs
from bridge.layout import IDENTITY
from models.config import get_preset
from bridge import tables
from bridge.sides import make_sides
from tests.golden import check_golden

DEFAULT_PARAM_COUNT = 1_104_218_112


GOLDENS = {
    'fsdp=8': 'default_specs_fsdp8.txt',
    'fsdp=4,tensor=2': 'default_specs_fsdp4_tensor2.txt',
    'data=2,fsdp=2,tensor=2': 'default_specs_data2_fsdp2_tensor2.txt',
}


@functools.cache
def _tables(mesh_spec: str):
  """(Linen rows, NNX rows) of the default preset's table on `mesh_spec`."""
  linen, nnx_side = make_sides(*get_preset('default'))
  mesh_sizes = specs.parse_mesh_spec(mesh_spec)
  return (
      tables.linen_rows(linen, mesh_sizes=mesh_sizes),
      tables.nnx_rows(nnx_side, mesh_sizes=mesh_sizes),
  )


@pytest.fixture(scope='module')
def default_tables():
  return _tables('fsdp=8')


@pytest.mark.parametrize('mesh_spec', GOLDENS)
@pytest.mark.parametrize('side', ['linen', 'nnx'])
def test_default_table_matches_golden(mesh_spec, side):
  rows = _tables(mesh_spec)[0 if side == 'linen' else 1]
  check_golden(GOLDENS[mesh_spec], tables.format_table(rows))


@pytest.mark.parametrize('mesh_spec', GOLDENS)
def test_default_sides_print_the_same_table(mesh_spec):
  linen_rows, nnx_rows = _tables(mesh_spec)
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


@pytest.mark.parametrize('mesh_spec', GOLDENS)
def test_default_target_shardings_are_the_table(mesh_spec):
  """What the sides place on a real mesh is what the table prints."""
  rows = _tables(mesh_spec)[0]
  for side in make_sides(*get_preset('default'), specs.make_mesh(mesh_spec)):
    wrong = tables.placement_mismatches(
        rows, side.checkpoint_shardings(), specs.parse_mesh_spec(mesh_spec)
    )
    assert not wrong, f'{side.name}:\n' + '\n'.join(wrong)
