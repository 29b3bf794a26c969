# Two entry points a newcomer needs: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck layers dist bench chaos chaos-long clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m broker_adapter demo

test: $(STAMP)
	$(PY) -m ruff check broker_adapter tests
	$(PY) -m ruff format --check broker_adapter tests
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) tests/tools/check_cycles.py
	$(PY) tests/tools/check_names.py
	$(MAKE) --no-print-directory dist
	$(PY) -m pytest -q

# The wheel and sdist people install, checked as a registry would check them.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --sdist --wheel --outdir dist . >/dev/null
	$(PY) -m twine check --strict dist/*

lint: $(STAMP)
	$(PY) -m ruff check broker_adapter tests
	$(PY) -m ruff format --check broker_adapter tests
	$(PY) -m ruff format --check broker_adapter tests

typecheck: $(STAMP)
	$(PY) -m mypy

layers: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) tests/tools/check_cycles.py
	$(PY) tests/tools/check_names.py

bench: $(STAMP)
	$(PY) bench/run.py

chaos: $(STAMP)
	$(PY) -m pytest -q -m chaos tests/chaos

SEED ?= 42
MODE ?= durable
# The long Jepsen-style soak: about 25 minutes on 2 cores.
chaos-long: $(STAMP)
	$(PY) -m tests.chaos.run --profile long --seed $(SEED) --redis-mode $(MODE) --out $(or $(OUT),/tmp/broker-adapter-chaos-long-$(SEED))

clean:
	rm -rf $(VENV) dist build .pytest_cache .mypy_cache .ruff_cache
