# Set-up is two commands on a fresh machine with Python 3 and make: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test torture bench check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/onward demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not torture" --durations=25 tests

torture: $(STAMP)
	$(PY) -m pytest -q -s -m torture tests
	ONWARD_HYPOTHESIS_EXAMPLES=300 $(PY) -m pytest -q tests/hostile
	ONWARD_FULL_FAULT_MATRIX=1 $(PY) -m pytest -q tests/crash/test_fault_matrix.py

check: $(STAMP)
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/mypy src/onward tools
	$(VENV)/bin/mypy tests
	$(PY) tools/check_imports.py

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
