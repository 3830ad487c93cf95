# Every target bootstraps .venv by itself: on a fresh clone `make demo` and `make test`
# are the only commands needed. The virtualenv is rebuilt when pyproject.toml changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
EXTRAS := dev,airflow,spark
PYTEST_ARGS ?=
# three pytest workers on 2 cores: most tests wait on servers and processes (fresh clones,
# same machine: 495 s with three, 582 s with two); the Spark tests stay in one worker (one
# JVM). PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 3

.PHONY: venv test test-slow demo bench bench-growth lint format clean explore

# the compiled fast path's sources (setup.py): an edited .pyx is rebuilt by the next target
PYX    := $(shell find airflow_nats_ordered -name '*.pyx' 2>/dev/null)

$(STAMP): pyproject.toml setup.py $(PYX)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "error: Python >= 3.11 is needed (found %s); set PYTHON=python3.11" % sys.version.split()[0])'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check uv \
	  || echo "uv unavailable: installing with pip (slower)"
	@if [ -x $(BIN)/uv ]; then \
	  $(BIN)/uv pip install -q --python $(BIN)/python -e '.[$(EXTRAS)]'; \
	else \
	  $(BIN)/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'; \
	fi
	@# uv keeps every build of pyspark's sdist (~700 MB each, one per fresh clone): CI runs on
	@# the developer's own disk, where 60 GB of them once filled it; keep only what is in use
	@if [ -x $(BIN)/uv ]; then $(BIN)/uv cache prune -q 2>/dev/null || true; fi
	@touch $(STAMP)

venv: $(STAMP)

# the suite, less the tests marked slow (end-to-end runs of a minute or more each: real
# triggerers run or killed, a spark-submit JVM re-submitted): those run one at a time in test-slow,
# which CI runs on its own before the suite, so neither waits behind the other's load
test: venv
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

test-slow: venv
	$(BIN)/python -m pytest -q -n 0 -m slow $(PYTEST_ARGS)

demo: venv
	$(BIN)/python -m airflow_nats_ordered.demo

bench: venv
	$(BIN)/python bench/compiled_bench.py && $(BIN)/python bench/run.py && $(BIN)/python bench/worker_bench.py && $(BIN)/python bench/drain_bench.py && $(BIN)/python bench/spark_bench.py && $(BIN)/python bench/global_bench.py

# how cost grows with members, partitions and input size (issue 19 item 5): separate from
# `make bench`, which already takes over 10 minutes; the 10M-record publisher run alone
# takes minutes and ~5 GB of stream storage (BENCH_GROWTH_PUB_N=1000000,3000000 for less)
bench-growth: venv
	$(BIN)/python bench/growth_bench.py

# the explorer (docs/explore.md): seeded random operations and faults over real processes,
# then the whole history checked. Without SEED: a few fixed seeds, briefly; with SEED: that
# seed for MINUTES. EXPLORE_ARGS passes more flags (--cluster, --ops ..., ...).
SEED ?=
MINUTES ?=
EXPLORE_ARGS ?=
explore: venv
	$(BIN)/python -m explore $(if $(SEED),--seed $(SEED),--seeds 1,2,3) --minutes $(or $(MINUTES),$(if $(SEED),10,0.5)) $(EXPLORE_ARGS)

CODE_DIRS := $(wildcard airflow_nats_ordered pyspark_nats_ordered dags spark_apps bench tests explore tools)

# ruff over all the code; mypy over the package (its settings: [tool.mypy] in pyproject.toml);
# lint-imports checks the import contracts ([tool.importlinter] in pyproject.toml: the core's
# layers, no Airflow or Spark in the core, no import cycle), run from here so that it finds
# tools/import_contracts.py
lint: venv
	$(BIN)/ruff check $(CODE_DIRS)
	$(BIN)/ruff format --check $(CODE_DIRS)
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

format: venv
	$(BIN)/ruff format $(CODE_DIRS)

clean:
	rm -rf $(VENV) .demo .bench .pytest_cache
