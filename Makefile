# `make test` and `make report` each create .venv if missing and install first.
# Another interpreter: make test PYTHON=python3.12 VENV=.venv312
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: test report clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# 4 workers even on 2 cores: XLA:CPU maps memory for every compiled program and
# a process keeps its programs, so one worker running half the suite passed
# Linux's default limit of 65,530 memory maps and crashed (segmentation faults
# in compilation and cache reads); measured here, 26,000 maps a fifth of the way.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 4 --hardware-on-cpu

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
