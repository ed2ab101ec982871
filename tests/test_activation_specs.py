"""Activation logical specs: every activation constraint of both train steps, compared.

The physical annotations of the lowered programs (tests/test_sharding.py)
cannot tell two logical names apart when the rules map both to one mesh
axis; these tables can (parity/activations.py). Per scenario the two sides
apply the same constraints, in the same program order, from the same model
methods, with the same logical names and the same physical specs on the
3-axis mesh; the `default` preset's table is a text golden.
"""
import functools

import pytest

from bridge import specs
from models.config import SCENARIOS, get_configs, get_preset
from parity import activations
from parity.sides import abstract_step_inputs, make_sides
from tests.golden import check_golden

THREE_AXES = specs.parse_mesh_spec('data=2,fsdp=2,tensor=2')
FSDP8 = specs.parse_mesh_spec('fsdp=8')


@functools.cache
def _tables(model_cfg, train_cfg, mesh_sizes: tuple):
  sides = make_sides(model_cfg, train_cfg)
  batch, key = abstract_step_inputs(model_cfg, train_cfg)
  return tuple(
      activations.rows(side, side.template, batch, key, mesh_sizes=dict(mesh_sizes))
      for side in sides
  )


@pytest.mark.parametrize('scenario', sorted(SCENARIOS))
def test_activation_specs_agree(scenario):
  model_cfg, train_cfg = get_configs('tiny', scenario)
  linen_rows, nnx_rows = _tables(model_cfg, train_cfg, tuple(THREE_AXES.items()))
  assert activations.drift(linen_rows, nnx_rows) == []
  assert linen_rows == nnx_rows
  # Not vacuous: the residual stream, attention, MLP and logits are all constrained.
  sites = {r['site'] for r in linen_rows}
  assert {'Decoder.__call__', 'DecoderLayer.__call__', 'Attention.__call__', 'MLP.__call__'} <= sites
  assert all(any(name is not None for name in r['logical']) for r in linen_rows)


def test_default_preset_activation_specs_golden():
  linen_rows, nnx_rows = _tables(*get_preset('default'), tuple(FSDP8.items()))
  assert activations.drift(linen_rows, nnx_rows) == []
  check_golden('default_activation_specs_fsdp8.txt', activations.format_table(linen_rows))
  check_golden('default_activation_specs_fsdp8.txt', activations.format_table(nnx_rows))


def test_drift_names_the_site_and_both_names():
  row = {
      'index': 3, 'site': 'DecoderLayer.__call__', 'context': 'jit/scan', 'shape': [8, 64, 64],
      'dtype': 'bfloat16', 'logical': ['activation_batch', None, 'activation_embed'],
      'physical': [['data', 'fsdp'], None, 'tensor'],
  }
  renamed = dict(row, logical=['activation_batch', None, 'activation_mlp'])
  (line,) = activations.drift([row], [renamed])
  assert line == (
      "#3 DecoderLayer.__call__ (jit/scan): logical Linen ('activation_batch',None,"
      "'activation_embed') vs NNX ('activation_batch',None,'activation_mlp')"
  )
