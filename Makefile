# Everything a developer or CI runs goes through these targets; the venv is built from pyproject.toml alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hearth-installed

.PHONY: install test test-unit test-integration test-e2e lint demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and by exact version: the cached CPU wheel satisfies it without pulling CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

test-e2e: $(STAMP)
	$(PY) -m pytest -q tests/e2e

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	$(VENV)/bin/hearth demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
