# The two commands of the README: `make run` and `make test`. Each creates or refreshes
# .venv, installs pagedjax into it, then does its job.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

export JAX_PLATFORMS ?= cpu

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(PY) scripts/fragmentation.py

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
