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
	$(PY) -m pip install -q -e '.[test,aot,bench]'
	touch $(STAMP)

venv: $(STAMP)

# The venv also holds libtpu and the CUDA plugin (for the deviceless compilation tests). On a
# machine with neither accelerator they would each try to start a device and print errors, so
# `make run` says "cpu" there; where a GPU or TPU is present, JAX picks it.
ACCELERATOR := $(shell command -v nvidia-smi 2>/dev/null; ls /dev/accel0 /dev/vfio/0 2>/dev/null)
RUN_ENV     := $(if $(strip $(ACCELERATOR)),,JAX_PLATFORMS=cpu)

# The main job: SmolLM2-135M on a mixed workload, continuous vs static vs contiguous vs HF
# (about 6 minutes on 2 CPU cores), then the fragmentation study and the timeline sandbox.
run: $(STAMP)
	$(RUN_ENV) $(PY) scripts/bench_serving.py
	$(RUN_ENV) $(PY) scripts/fragmentation.py
	$(RUN_ENV) $(PY) scripts/timeline.py

# Tests run on the CPU, every Pallas kernel in interpret mode.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
