"""The migration guide (notebooks/migration_guide.ipynb) runs top to bottom on CPU.

Every section of the guide ends in assertions, so executing it is the test:
a cell that raises fails it, with the cell's traceback. The kernel runs this
very interpreter (a kernelspec written to a temporary directory, never the
user's installed kernels), in the notebook's own folder, as a user would
open it; matplotlib draws with Agg. The paired script
(notebooks/migration_guide.py, jupytext percent format) is the source of
truth: the notebook must hold the same cells, with no outputs.

Wall time, one CPU core, from a cold jax compilation cache: 47 s on
Python 3.11 (jax 0.10), 40 s on Python 3.12 (jax 0.12); compiling the tiny
model's steps is nearly all of it. With the persistent compilation cache that
conftest.py sets up already holding those programs (a second run, or other
tests of the suite having compiled them), about 7 s. Section 11 (a model-level
pair's parts, then a slipped port's gradients) added about 4 s to a warm run
(57 s to 61 s on 2 cores shared with other work, load near 7). One xdist group
of its own.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / 'notebooks'
NOTEBOOK = NOTEBOOKS / 'migration_guide.ipynb'
SCRIPT = NOTEBOOKS / 'migration_guide.py'
REGENERATE = 'jupytext --to ipynb notebooks/migration_guide.py'  # afresh: no outputs (--update keeps them)
# Generous: the guide takes about a minute on one core; a hung cell must not hang the suite.
CELL_TIMEOUT_S = 600

EXTRA = "needs the test extra: pip install -e '.[test]'"
nbformat = pytest.importorskip('nbformat', reason=EXTRA)
nbclient = pytest.importorskip('nbclient', reason=EXTRA)
jupytext = pytest.importorskip('jupytext', reason=EXTRA)
pytest.importorskip('ipykernel', reason=EXTRA)

pytestmark = pytest.mark.xdist_group('notebook')


def _cells(notebook) -> list[tuple[str, str]]:
  return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_notebook_is_the_script_without_outputs():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  script = jupytext.read(SCRIPT)
  assert _cells(notebook) == _cells(script), (
      f'{NOTEBOOK.name} is out of date with {SCRIPT.name}; regenerate: {REGENERATE}'
  )
  with_outputs = [
      i for i, cell in enumerate(notebook.cells)
      if cell.cell_type == 'code' and (cell.outputs or cell.execution_count is not None)
  ]
  assert not with_outputs, (
      f'{NOTEBOOK.name}: cells {with_outputs} hold outputs; strip them: {REGENERATE}'
  )


# Run in a child process: the Jupyter client leaves threads (zmq, an asyncio
# loop) behind in the process that executes a notebook. Workers that had run
# this test crashed later (segmentation faults in XLA compilation or in jax's
# cache read); the cause turned out to be Linux's memory-map limit, which any
# worker could reach (parity/env/map_limit.py), but the kernel's threads and
# programs stay out of the worker all the same. The child writes the executed
# notebook, which the test reads.
_EXECUTE = r"""
import sys
import nbclient, nbformat
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

source, out, kernel_dirs, path, timeout = sys.argv[1:]
name = 'parity-test'
# The default argv is `sys.executable -m ipykernel_launcher -f {connection_file}`.
write_kernel_spec(f'{kernel_dirs}/{name}', overrides={'display_name': f'pytest ({sys.executable})'})
specs = KernelSpecManager(kernel_dirs=[kernel_dirs], ensure_native_kernel=False)
manager = KernelManager(kernel_name=name, kernel_spec_manager=specs)
assert manager.kernel_spec.argv[0] == sys.executable
notebook = nbformat.read(source, as_version=4)
client = nbclient.NotebookClient(
    notebook, km=manager, timeout=int(timeout), resources={'metadata': {'path': path}}
)
try:
  client.execute()  # raises CellExecutionError, with the cell's traceback, on any error
finally:
  nbformat.write(notebook, out)
"""


@pytest.mark.exhaustive
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
  monkeypatch.setenv('MPLBACKEND', 'Agg')
  # Nothing of the user's Jupyter or IPython set-up (startup files, runtime dir) is used.
  monkeypatch.setenv('IPYTHONDIR', str(tmp_path / 'ipython'))
  monkeypatch.setenv('JUPYTER_RUNTIME_DIR', str(tmp_path / 'runtime'))
  executed = tmp_path / 'executed.ipynb'
  start = time.perf_counter()
  done = subprocess.run(
      [sys.executable, '-c', _EXECUTE, str(NOTEBOOK), str(executed), str(tmp_path / 'kernels'),
       str(NOTEBOOKS), str(CELL_TIMEOUT_S)],
      capture_output=True, text=True, timeout=1800,
  )
  elapsed = time.perf_counter() - start
  print(f'notebook executed in {elapsed:.1f} s')
  assert done.returncode == 0, done.stderr[-6000:]
  notebook = nbformat.read(executed, as_version=4)

  code = [cell for cell in notebook.cells if cell.cell_type == 'code']
  assert all(cell.execution_count is not None for cell in code), 'not every cell ran'
  errors = [out for cell in code for out in cell.outputs if out.output_type == 'error']
  assert not errors
  text = '\n'.join(
      out.get('text', '') for cell in code for out in cell.outputs if out.output_type == 'stream'
  )
  # The kernel ran the interpreter under test, with the 8 CPU devices of the first cell.
  assert 'cpu devices' in text, text[:2000]
  assert 'verdict: bit-identical' in text
