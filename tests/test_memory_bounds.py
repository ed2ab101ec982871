"""A declared memory bound per platform, and per mesh: each read where it is measured, held to the
same tightness rule (parity.pairs.adapter.KnownDifference.max_temp_bytes, `placement`)."""
from __future__ import annotations

import pytest

import parity
from parity.pairs import adapter
from parity.run import verdicts

MESH = {'data': 2, 'stage': 1, 'fsdp': 2, 'tensor': 2}
ON_MESH = 'cpu@data=2,fsdp=2,tensor=2'


def _declared(bound):
  return parity.KnownDifference(('norm',), ('program', 'memory'), 'stock lowering', max_changed_lines=10,
                                max_temp_bytes=bound)


def _memory(temp):
  return {'argument_bytes': 100, 'output_bytes': 100, 'alias_bytes': 0, 'temp_bytes': temp, 'peak_bytes': 200 + temp}


def test_a_placement_names_the_platform_and_the_mesh_axes_of_more_than_one_device():
  assert adapter.placement('cpu') == 'cpu' and adapter.placement('cpu', {'data': 1}) == 'cpu'
  assert adapter.placement('cpu', MESH) == ON_MESH
  assert adapter.placement('gpu', {'tensor': 2, 'data': 4}) == 'gpu@data=4,tensor=2'


def test_a_bound_per_mesh_is_read_on_that_mesh_and_the_platforms_elsewhere():
  known = _declared({'cpu': 1024, 'cpu@tensor=2, data=2, fsdp=2': 4352})  # any order, any spacing
  assert dict(known.max_temp_bytes) == {'cpu': 1024, ON_MESH: 4352}
  assert known.temp_bytes('cpu') == 1024
  assert known.temp_bytes(adapter.placement('cpu', MESH)) == 4352
  assert known.temp_bytes('cpu@data=8') == 1024  # a mesh it does not name: the platform's bound
  assert known.temp_bytes('gpu') is None and known.temp_bytes('gpu@data=8') is None
  only_mesh = _declared({ON_MESH: 4352})
  assert only_mesh.temp_bytes('cpu') is None and only_mesh.temp_bytes(ON_MESH) == 4352


@pytest.mark.parametrize('bound', [{'cpu@data': 8}, {'cpux@data=2': 8}, {'cpu@data=2,data=2': 8},
                                   {'cpu@data=1': 8}, {'cpu@data=2': -1}])
def test_a_bound_of_no_platform_or_mesh_is_refused(bound):
  with pytest.raises(ValueError, match="a platform on a mesh \\('cpu@data=2,tensor=2'"):
    _declared(bound)


def test_each_bound_admits_and_is_held_tight_where_it_is_measured():
  """4,352 B more temporaries on the mesh, 1,024 B on one device: each admitted by its own bound;
  the mesh's bound is loose against a mesh that moves 1,000 B, and the fix names the mesh."""
  known = _declared({'cpu': 1024, ON_MESH: 4352})
  linen = _memory(1000)
  assert verdicts.declared_memory_admits(known, linen, _memory(1000 + 4352), ON_MESH)
  assert not verdicts.declared_memory_admits(known, linen, _memory(1000 + 4352), 'cpu')
  assert verdicts.declared_memory_admits(known, linen, _memory(1000 + 1024), 'cpu')
  assert known.loose_structure('memory', 4352, ON_MESH) == ''
  assert known.loose_structure('memory', 1024, 'cpu') == ''
  loose = known.loose_structure('memory', 1000, ON_MESH)
  assert 'is loose' in loose and f"'{ON_MESH}': 1000" in loose, loose


def test_a_compare_result_on_a_mesh_reads_the_meshs_bound():
  """`parity compare --mesh`: the result's memory verdict reads the bound of the mesh it ran on."""
  known = _declared({'cpu': 1024, ON_MESH: 4352})
  steps = [verdicts.SideRun(name, memory=m) for name, m in (('linen', _memory(1000)), ('nnx', _memory(5352)))]
  result = verdicts.CompareResult(steps=1, init_side='linen', linen=steps[0], nnx=steps[1], first_divergent_step=None,
                                state_diffs=[], metric_diffs=[], seed=0, mesh_shape=MESH, platform='cpu',
                                declared_program_difference=known)
  assert result.memory_verdict.startswith('differs within the declared bound'), result.memory_verdict
  assert 'at most 4,352 B of temporaries' in result.memory_verdict
  one_device = verdicts.CompareResult(steps=1, init_side='linen', linen=steps[0], nnx=steps[1], first_divergent_step=None,
                                    state_diffs=[], metric_diffs=[], seed=0, platform='cpu',
                                    declared_program_difference=known)
  assert one_device.memory_verdict.startswith('differs (NNX'), one_device.memory_verdict
