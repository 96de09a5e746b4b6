# Two user-facing targets: `make demo` and `make test`. Both build .venv from scratch when needed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: demo test test-cuda clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

# pip writes the installed files' bytecode one file at a time, most of the install's time (torch
# alone has thousands); compileall does the same on every core. It skips the packages' own test
# suites and the packages nothing here imports (a fifth of the files; Python compiles any of them
# when first imported). It reports the files written for newer Pythons than this one (pip skips
# those too), hence the `|| true`.
UNIMPORTED := /(tests?|networkx|pip|prompt_toolkit|pyarrow)/
COMPILE := $(PY) -m compileall -q -j 0 -x '$(UNIMPORTED)' $(VENV)/lib > /dev/null || true

$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install --quiet --no-compile --no-build-isolation -e .
	$(COMPILE)
	touch $@

# torch is pinned to the CPU wheel; taming-transformers declares a CUDA torch and pytorch-lightning
# as dependencies although its `taming.modules` need only torch, hence --no-deps.
# The dev extra holds the runtime install too: one pip resolution and one compile for both.
$(VENV)/.installed-dev: $(PY) pyproject.toml
	$(PIP) install --quiet --no-compile --no-build-isolation -e ".[dev]"
	$(PIP) install --quiet --no-compile --no-deps taming-transformers==0.0.1
	$(COMPILE)
	touch $(VENV)/.installed $@

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
