# The two commands of the README: `make run` and `make test`. Each creates or refreshes
# .venv, installs pagedjax into it, then does its job.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The main job: SmolLM2-135M on a mixed workload, continuous vs static vs contiguous vs HF
# (about 9 minutes on 2 CPU cores), then the fragmentation study and the timeline sandbox.
run: $(STAMP)
	$(PY) scripts/bench_serving.py
	$(PY) scripts/fragmentation.py
	$(PY) scripts/timeline.py

# Tests run on the CPU, every Pallas kernel in interpret mode.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
