"""`parity specs --pair FILE.py:NAME`: a declared pair's spec tables, through the command line.

The parameter table (path, shape, dtype, annotation, placement on the pair's first
mesh or `--mesh`) and, with `--activations`, every activation constraint of both
train steps, each named by the module it is in; the differences are the battery's
specs part's (exit 1), bad input exit 2. The small pairs with a planted difference
are tests/small_pairs.py's.
"""
from __future__ import annotations

import json

import pytest

from parity.battery import checks
from parity.compare import activations
from parity.run import cli
from tests import small_pairs

PRODUCTION = 'tests/test_family_production.py:production'
SMALL = 'tests/small_pairs.py'


def _json(capsys, argv):
  """(exit status, the JSON `parity specs` prints) of one in-process run."""
  status = cli.main(argv + ['--format', 'json'])
  return status, json.loads(capsys.readouterr().out)


def test_the_production_pairs_parameter_table_on_its_own_mesh(capsys):
  status, out = _json(capsys, ['specs', '--pair', PRODUCTION])
  assert status == 0 and out['equal'] is True and out['differences'] == []
  assert out['mesh'] == 'data=2,stage=1,fsdp=2,sequence=1,tensor=2'  # the pair's first mesh
  assert out['param_count'] == 35_040
  for side in ('linen', 'nnx'):
    rows = {r['path']: r for r in out[side]}
    assert len(rows) == 12
    assert rows['params/layers/mlp/wi_0/kernel'] == {
        'path': 'params/layers/mlp/wi_0/kernel', 'shape': [3, 32, 64], 'dtype': 'float32',
        'logical': ['layers', 'embed', 'mlp'], 'physical': [None, 'fsdp', 'tensor'], 'convention': 'logical names'}
    assert rows['params/embed/embedding']['physical'] == ['tensor', 'fsdp']
    assert rows['params/final_norm/scale']['logical'] == ['norm']


def test_the_language_models_two_conventions_are_placed_on_the_mesh_asked_for(capsys):
  """The LM's NNX side annotates with mesh axes (its rules applied): each side's annotation
  is placed in its own convention, and the specs part's note says the placements agree."""
  status = cli.main(['specs', '--pair', 'tests/test_family_lm.py:lm', '--mesh', 'data=2,tensor=4'])
  out = capsys.readouterr().out
  assert status == 0, out
  assert out.startswith('pair lm, mesh data=2,tensor=4: 37 parameters')
  linen, nnx_side = out.split('\nLinen:\n')[1].split('\nNNX:\n')
  assert ("params/DecoderBlock_0/MlpBlock_0/Dense_0/kernel float32[32,64] logical=('embed','mlp')"
          " physical=(None,'tensor')\n") in linen
  assert ("params/DecoderBlock_0/MlpBlock_0/Dense_0/kernel (NNX params/blocks/0/mlp/linear1/kernel)"
          " float32[32,64] mesh_axes=(None,'tensor') physical=(None,'tensor')\n") in nnx_side  # not logical=
  assert ('parameter specs: Linen annotates with logical names, NNX with mesh axes; the placements'
          ' agree on data=2,tensor=4 (37 parameters)\nspecs equal on both sides\n') in out


@pytest.mark.exhaustive  # traces both production train steps (the small pairs' run in the core tier)
def test_the_production_pairs_activation_table_names_each_constraints_module(capsys):
  status, out = _json(capsys, ['specs', '--pair', PRODUCTION, '--activations'])
  assert status == 0 and out['differences'] == []
  assert out['notes'] == ['activation constraints: 24 per train step, the same logical names on both sides']
  for side in ('linen', 'nnx'):
    rows = out[side]
    assert len(rows) == 24
    mlp = rows[6]
    assert (mlp['module'], mlp['linen_module'], mlp['site'], mlp['context']) == (
        'layers/mlp', 'layers/mlp', 'Mlp.__call__', 'jit/jit/scan')
    assert mlp['logical'] == ['activation_batch', 'activation_length', 'activation_mlp']
    assert mlp['physical'] == [['data', 'fsdp'], None, 'tensor']
    assert rows[0]['module'] == '' and rows[0]['site'] == 'Transformer.__call__'  # the model's own
  # One constraint in the scanned body is every layer's: a difference there says so.
  renamed = [dict(r) for r in out['nnx']]
  renamed[6]['logical'] = ['activation_batch', 'activation_length', 'activation_embed']
  assert activations.drift(out['linen'], renamed, sites=False) == [
      'module layers/mlp, every layer of the scanned stack (#6 Mlp.__call__, jit/jit/scan): logical Linen'
      " ('activation_batch','activation_length','activation_mlp') vs NNX #6"
      " ('activation_batch','activation_length','activation_embed')"]


def test_a_parameter_annotated_otherwise_exits_1_naming_it(capsys):
  status = cli.main(['specs', '--pair', f'{SMALL}:renamed_annotation'])
  out = capsys.readouterr().out
  assert status == 1, out
  assert ("params/Block_0/Dense_0/kernel (NNX params/block/linear/kernel) float32[6,16]"
          " logical=('embed','mlp') physical=(None,'tensor')\n") in out
  assert out.endswith(
      'specs differ between Linen and NNX (1):\n'
      "  params/Block_0/Dense_0/kernel: renamed_annotation parameters: expected ('embed', 'hidden') (Linen),"
      " got ('embed', 'mlp') (NNX)\n")


CONSTRAINT_DIFFERS = ("module Block_0 (#0 Block.__call__, jit/jit): logical Linen ('batch','hidden')"
                      " vs NNX #0 in module block ('batch','mlp')")


def test_a_constraint_named_otherwise_exits_1_naming_its_module(capsys):
  status = cli.main(['specs', '--pair', f'{SMALL}:renamed_constraint', '--activations'])
  out = capsys.readouterr().out
  assert status == 1, out
  assert ("0000 block (Linen Block_0) NnxBlock.__call__ jit/jit [8,16] float32 ('batch','mlp')"
          " ('data','tensor')\n") in out
  assert f'activation specs differ between Linen and NNX (2):\n  {CONSTRAINT_DIFFERS}\n' in out


def test_the_specs_part_names_a_constraint_by_its_module():
  """The battery's part, on the same planted difference: Linen's scope path, NNX's attribute path."""
  with pytest.raises(AssertionError) as failure:
    checks.check_specs(small_pairs.renamed_constraint)
  assert str(failure.value).splitlines()[1] == f'  {CONSTRAINT_DIFFERS}'


@pytest.mark.parametrize('argv,message', [
    (['--mesh', 'data=2,tensor=x'], 'bad mesh spec'),
    (['--preset', 'tiny'], '--preset and --scenario choose the reference decoder'),
])
def test_bad_input_exits_2(argv, message, capsys):
  assert cli.main(['specs', '--pair', f'{SMALL}:same', *argv]) == 2
  assert message in capsys.readouterr().err
