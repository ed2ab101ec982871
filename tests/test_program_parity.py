"""The same program, not only the same numbers: memory and canonical programs per scenario.

For every scenario, on one device and on the 3-axis mesh, XLA's memory
analysis of the two compiled train steps (argument, output, temporary,
aliased and peak bytes) is equal to the byte, and the canonical programs are
identical except for the allowed differences (`parity.programs.ALLOWED`,
today only the step counter's dtype). `10_scan_axis0` stores the NNX layers
on another axis on purpose; its programs differ and the report says why.

The numbers come from runs the suite makes anyway (`tests.runs`): nothing
here compiles a step of its own.
"""
import pytest

from bridge.layout import layout_for
from models.config import SCENARIOS, get_configs
from parity import programs, runner
from tests.runs import mesh_run, tiny_run

THREE_AXES = 'data=2,fsdp=2,tensor=2'
SAME_LAYOUT = [s for s in sorted(SCENARIOS) if not layout_for(get_configs('tiny', s)[0]).moves]
ALLOWED = [a.name for a in programs.ALLOWED]


def _check(memory: tuple[dict, dict], diff: programs.ProgramDiff) -> None:
  assert all(memory[0].get(f) is not None for f in runner.MEMORY_FIELDS), memory[0]
  assert runner.memory_drift(*memory) == []
  assert diff.identical, diff.summary() + '\n' + diff.diff
  assert diff.allowed == ALLOWED


@pytest.mark.parametrize('scenario', SAME_LAYOUT)
def test_memory_and_program_equal_on_one_device(scenario):
  result = tiny_run(scenario)
  _check((result.linen.memory, result.nnx.memory), result.program_diff)


@pytest.mark.parametrize('scenario', SAME_LAYOUT)
def test_memory_and_program_equal_on_the_three_axis_mesh(scenario):
  run = mesh_run(scenario, THREE_AXES)
  _check(run.memory, run.program_diff)


def test_the_other_layout_is_a_stated_program_difference():
  """`10_scan_axis0`: the layers' axis differs by design, so the programs do too."""
  result = tiny_run('10_scan_axis0')
  assert layout_for(result.model_cfg).moves
  assert not result.program_diff.identical
