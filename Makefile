# Two user-facing targets: `make demo` and `make test`. Both build .venv from scratch when needed.
# The distribution's Python 3.11 where it can make venvs, before one found on PATH: Debian's links
# libpython into the executable, while a pyenv build configured without --enable-optimizations
# loads it as a shared library; the suite, mostly JAX tracing and lowering in Python, runs about a
# tenth faster on Debian's (benchmarks/results/suite.md). `make clean` after it changes.
DISTRIBUTION_PYTHON := $(shell /usr/bin/python3.11 -c "import ensurepip, venv" 2>/dev/null && echo /usr/bin/python3.11)
PYTHON ?= $(or $(DISTRIBUTION_PYTHON),$(shell command -v python3.11 || command -v python3))
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: demo test test-cuda test-newest gpu-wheels clean

# The dev/CI environment's exact versions (pip constraints); pyproject.toml declares only ranges.
LOCK := envs/lock-py311.txt
TAMING := taming-transformers==0.0.1

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

$(VENV)/.installed: $(PY) pyproject.toml $(LOCK)
	$(PIP) install --quiet --no-compile --no-build-isolation -c $(LOCK) -e .
	$(COMPILE)
	touch $@

# The lock pins torch to the CPU wheel; taming-transformers declares a CUDA torch and pytorch-lightning
# as dependencies although its `taming.modules` need only torch, hence --no-deps.
# The dev extra holds the runtime install too: one pip resolution and one compile for both.
$(VENV)/.installed-dev: $(PY) pyproject.toml $(LOCK)
	$(PIP) install --quiet --no-compile --no-build-isolation -c $(LOCK) -e ".[dev]"
	$(PIP) install --quiet --no-compile --no-deps $(TAMING)
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

$(VENV_GPU)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	$(VENV_GPU)/bin/python -m pip install --quiet -c $(LOCK) -e ".[cuda-lowering]"
	touch $@

test-cuda: $(VENV_GPU)/.installed
	$(VENV_GPU)/bin/python -m pytest -m cuda $(CUDA_TESTS)

# The newest JAX on PyPI (Python 3.13, in a Debian 13 root kept in .newest/; needs root): the
# tests that need no PyTorch, demo.py and a TPU compile. See envs/newest.sh.
test-newest:
	envs/newest.sh

clean:
	rm -rf --one-file-system $(VENV) $(VENV_GPU) runs .newest

# What benchmarks/gpu/check.py and the cuda tests import that the lent GPU machines' image lacks
# (it has jax with the CUDA plugin, flax, optax, orbax, chex, torch: docs/accelerators.md), as
# wheels for its Python 3.12 at the lock's versions, in .whl/ for benchmarks/gpu/run.sh to
# install there. tensorflow-datasets and grain come in through attnjax.data, which the training
# loop and tests/helpers.py import. promise (imported by tensorflow-datasets) is on PyPI as an
# sdist only: its wheel is built here (pure Python). taming-transformers is the PyTorch side of
# the VQGAN and sampling rows (installed --no-deps, as in the dev environment).
GPU_WHEELS := array_record grain immutabledict ml_collections portpicker tensorflow-datasets \
	tensorflow-metadata toml promise
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64 manylinux1_x86_64

gpu-wheels:
	rm -rf .whl && mkdir .whl
	for name in $(GPU_WHEELS); do \
		grep -i "^$$name==" $(LOCK) || { echo "$$name is not pinned in $(LOCK)" >&2; exit 1; }; \
	done > .whl/requirements.txt
	grep -v '^promise==' .whl/requirements.txt | xargs python3 -m pip download --quiet \
		--no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(foreach p,$(GPU_PLATFORMS),--platform $(p)) -d .whl
	grep '^promise==' .whl/requirements.txt | xargs python3 -m pip wheel --quiet --no-deps -w .whl
	python3 -m pip download --quiet --no-deps --only-binary=:all: -d .whl $(TAMING)
	@ls .whl/*.whl
	@du -ch .whl/*.whl | tail -1
