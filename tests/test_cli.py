"""The `parity` command line, run in-process (no new interpreter per test)."""
import json

import pytest

from parity import cli

DESIGN_TABLE = {
    'params/params/decoder/decoder_norm/scale': ([2048], ['norm'], [None]),
    'params/params/decoder/layers/mlp/wi_0/kernel': ([2048, 16, 7168], ['embed', 'layers', 'mlp'], ['fsdp', None, None]),
    'params/params/decoder/layers/mlp/wi_1/kernel': ([2048, 16, 7168], ['embed', 'layers', 'mlp'], ['fsdp', None, None]),
    'params/params/decoder/layers/mlp/wo/kernel': ([7168, 16, 2048], ['mlp', 'layers', 'embed'], [None, None, 'fsdp']),
    'params/params/decoder/layers/post_self_attention_layer_norm/scale': ([2048, 16], ['norm', 'layers'], [None, None]),
    'params/params/decoder/layers/pre_self_attention_layer_norm/scale': ([2048, 16], ['norm', 'layers'], [None, None]),
    'params/params/decoder/layers/self_attention/key/kernel': ([2048, 16, 16, 128], ['embed', 'layers', 'kv_heads', 'kv_head_dim'], ['fsdp', None, None, None]),
    'params/params/decoder/layers/self_attention/out/kernel': ([16, 16, 128, 2048], ['heads', 'layers', 'kv', 'embed'], [None, None, None, 'fsdp']),
    'params/params/decoder/layers/self_attention/query/kernel': ([2048, 16, 16, 128], ['embed', 'layers', 'q_heads', 'kv'], ['fsdp', None, None, None]),
    'params/params/decoder/layers/self_attention/value/kernel': ([2048, 16, 16, 128], ['embed', 'layers', 'kv_heads', 'kv_head_dim'], ['fsdp', None, None, None]),
    'params/params/decoder/logits_dense/kernel': ([2048, 32000], ['embed_vocab', 'vocab'], ['fsdp', None]),
    'params/params/token_embedder/embedding': ([32000, 2048], ['vocab', 'embed_vocab'], [None, 'fsdp']),
}


def test_specs_json_reproduces_the_design_table(capsys):
  assert cli.main(['specs', '--preset', 'default', '--mesh', 'fsdp=8', '--format', 'json']) == 0
  out = json.loads(capsys.readouterr().out)
  assert out['param_count'] == 1_104_218_112
  assert out['equal'] is True
  for side in ('linen', 'nnx'):
    got = {r['path']: (r['shape'], r['logical'], r['physical']) for r in out[side]}
    assert got == DESIGN_TABLE
    assert {r['dtype'] for r in out[side]} == {'float32'}


def test_compare_reports_bit_identical(capsys, tmp_path):
  report = tmp_path / 'report.json'
  assert cli.main(['compare', '--steps', '2', '--json', str(report)]) == 0
  assert 'verdict: bit-identical' in capsys.readouterr().out
  data = json.loads(report.read_text())
  assert data['bitwise_equal'] is True
  assert data['first_divergent_step'] is None
  assert len(data['linen']['losses']) == 2
  assert data['linen']['losses'] == data['nnx']['losses']


@pytest.mark.parametrize('argv, message', [
    (['compare', '--preset', 'huge'], "unknown preset 'huge'"),
    (['specs', '--mesh', 'fsdp=3,tensor=x'], 'bad mesh spec'),
    (['compare', '--steps', '0'], '--steps must be at least 1'),
])
def test_bad_input_exits_2_with_one_message(capsys, argv, message):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err
  assert len(err.strip().splitlines()) == 1
