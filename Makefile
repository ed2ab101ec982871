# `make test`, `make test-all` and `make report` each create .venv if missing and install first.
# Another interpreter: make test PYTHON=python3.12 VENV=.venv312
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: test test-all report clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# One xdist worker per core (`-n auto`). XLA:CPU maps memory for every
# compiled program and a worker keeps its programs: one running half the suite
# passed Linux's limit of 65,530 memory maps and crashed in XLA. The plugin
# now drops jax's in-memory caches in a worker past half the limit
# (parity/env/map_limit.py), so the worker count is free again; on 2 cores, 2
# workers were faster than 4 (warm: 147 s against 164 s).
#
# `make test` runs the core tier, `make test-all` both tiers (tests/tiers.py).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n auto --hardware-on-cpu

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -n auto --hardware-on-cpu --exhaustive

report: $(STAMP)
	$(VENV)/bin/parity compare

# The migration guide in Jupyter (the `notebook` extra on top of the test set-up).
.PHONY: notebook
NOTEBOOK_STAMP := $(VENV)/.installed-notebook

$(NOTEBOOK_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -e '.[test,notebook]'
	touch $(NOTEBOOK_STAMP)

notebook: $(NOTEBOOK_STAMP)
	$(VENV)/bin/jupyter notebook notebooks/migration_guide.ipynb

clean:
	rm -rf $(VENV) .pytest_cache
