"""Activation logical specs: every activation constraint of both train steps, compared.

The physical annotations of the lowered programs (tests/test_sharding.py)
cannot tell two logical names apart when the rules map both to one mesh
axis; these tables can (parity/compare/activations.py). Per scenario the two sides
apply the same constraints, in the same program order, from the same model
methods, with the same logical names and the same physical specs on the
3-axis mesh; the `default` preset's table is a text golden.
"""
import functools

import pytest

from parity.core import specs
from models.config import SCENARIOS, get_configs, get_preset
from parity.compare import activations
from bridge.sides import abstract_step_inputs, make_sides
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
      "'activation_embed') vs NNX #3 ('activation_batch',None,'activation_mlp')"
  )


def test_a_constraint_one_side_lacks_is_one_line_not_a_shift_of_the_later_ones():
  """Constraints are aligned by what they apply to (control flow, shape, dtype), so a
  constraint NNX leaves out is named once, and those after it still compare with theirs."""
  def row(index, shape, logical):
    return {'index': index, 'site': 'Block.__call__', 'context': 'jit', 'shape': shape,
            'dtype': 'float32', 'logical': logical, 'physical': None}

  hidden, mlp, out = [8, 8, 32], [8, 8, 128], [8, 8, 64]
  linen = [row(0, hidden, ['batch', 'length', 'embed']), row(1, mlp, ['batch', 'length', 'mlp']),
           row(2, out, ['batch', 'length', 'vocab']), row(3, hidden, ['batch', 'length', 'embed'])]
  nnx_rows = [row(0, hidden, ['batch', 'length', 'embed']), row(1, out, ['batch', 'length', 'vocab']),
              row(2, hidden, ['batch', 'length', None])]
  assert activations.drift(linen, nnx_rows) == [
      "#1 Block.__call__ (jit) [8, 8, 128] float32: only on Linen, logical ('batch','length','mlp')",
      "#3 Block.__call__ (jit): logical Linen ('batch','length','embed') vs NNX #2 ('batch','length',None)",
  ]


@pytest.mark.exhaustive
@pytest.mark.xdist_group('01_baseline')  # its sides and start are that scenario's
def test_the_battery_names_a_constraint_renamed_on_one_side(monkeypatch):
  """The plugin's specs part reads activation constraints too (parity.battery.checks.check_specs).

  The NNX decoder's residual stream constrained by `activation_mlp` instead
  of `activation_embed`: no number changes, and under the default rules no
  mesh axis either; the battery names the constraint and both names.
  """
  import dataclasses

  from models import data
  from models.nnx import decoder as nnx_decoder
  from parity.battery import checks as battery
  from parity.pairs.adapter import Pair

  def pair(name, model_cfg, train_cfg):
    return Pair(
        name,
        lambda mesh: make_sides(model_cfg, train_cfg, mesh),
        lambda step, split='train': data.make_batch(model_cfg, train_cfg, step=step, split=split),
    )

  model_cfg, train_cfg = get_configs('tiny', '01_baseline')
  (line,) = battery.check_specs(pair('decoder_constraints', model_cfg, train_cfg))
  assert line.startswith('activation constraints: ') and line.endswith('the same logical names on both sides')
  renamed = tuple('activation_mlp' if n == 'activation_embed' else n for n in nnx_decoder.EMBED_AXES)
  monkeypatch.setattr(nnx_decoder, 'EMBED_AXES', renamed)
  # Sides of their own (one layer), traced after the change.
  broken = pair('decoder_renamed_constraint', dataclasses.replace(model_cfg, num_layers=1), train_cfg)
  with pytest.raises(AssertionError) as info:
    battery.check_specs(broken)
  message = str(info.value)
  assert 'decoder_renamed_constraint: activation constraints differ' in message
  assert "'activation_embed'" in message and "'activation_mlp'" in message
