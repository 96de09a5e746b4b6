# Two user-facing targets: `make demo` and `make test`. Both build .venv from scratch when needed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: demo test test-cuda clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install --quiet -e .
	touch $@

# torch is pinned to the CPU wheel; taming-transformers declares a CUDA torch and pytorch-lightning
# as dependencies although its `taming.modules` need only torch, hence --no-deps.
$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps taming-transformers==0.0.1
	touch $@

demo: $(VENV)/.installed
	$(PY) demo.py

# Two workers: most of the suite is XLA compilation and subprocesses, which use one core each.
# loadgroup: tests marked with one xdist_group run on one worker (the multi-process runs one at a
# time; tests sharing a module-scoped run train it once).
test: $(VENV)/.installed-dev
	$(PY) -m pytest -n 2 --dist loadgroup -m "not cuda" tests

# Programs lowered for CUDA (cuDNN attention) need the jax CUDA plugin, 5.7 GB with its NVIDIA
# libraries: its own environment, and only the test files that hold `cuda`-marked tests (the
# others import torch, which this environment does not have).
VENV_GPU   := .venv-gpu
CUDA_TESTS := tests/ops/test_kernel_choice_cuda.py tests/compile/test_compile.py

$(VENV_GPU)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	$(VENV_GPU)/bin/python -m pip install --quiet -e ".[cuda-lowering]"
	touch $@

test-cuda: $(VENV_GPU)/.installed
	$(VENV_GPU)/bin/python -m pytest -m cuda $(CUDA_TESTS)

clean:
	rm -rf $(VENV) $(VENV_GPU) runs
