#!/usr/bin/env bash
# The language-model family's and the production-shaped pair's own batteries on an accelerator,
# bit for bit with deterministic ops (docs/accelerators.md records what it gave). Run from the
# repository root on a GPU host with the project installed (`pip install --no-deps -e .`):
#   bash benchmarks/gpu_families.sh OUT_DIR
# The pair files run from a directory outside the repository, so the suite's conftest (which
# puts the CPU battery on the CPU) does not apply: the plugin runs them on the default backend,
# one device (`--parity-mesh=data=1`; the production pair's mesh factory lays its other axes at 1).
set -uo pipefail
out=${1:-/tmp/gpu-families}
repo=$(pwd)
mkdir -p "$out" "$out/run"
cp tests/test_family_lm.py tests/test_family_production.py "$out/run/"
cd "$out/run"
python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())' | tee "$out/versions.txt"
# The plugin by its entry point where the project is installed, else named.
plugin=$(python -c "import importlib.metadata as m; print('' if [e for e in m.entry_points(group='pytest11') if e.name == 'parity'] else '-p parity.battery.plugin')")
PYTHONPATH="$repo" XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true" \
  python -m pytest -q -p no:cacheprovider $plugin -m 'not exhaustive' -o 'markers=exhaustive: the suite tier' --parity-mesh=data=1 -n 0 -rA \
  --durations=10 -k 'not save_dots' test_family_lm.py test_family_production.py 2>&1 | tee "$out/pytest.log" | tail -80
