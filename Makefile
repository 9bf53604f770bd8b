# Entry points for a fresh machine (see README):
#   make demo   -> venv, install, `remat bench`: on a GPU the real bench; without one, what a CPU
#                  proves (exact gradients, CPU peaks beside predictions, llama-1b's predicted frontier)
#   make test   -> venv, install with test extras, run the test suite less its `slow` tests
#                  (target: under 10 minutes on 2 cores; CI's .ci/run runs this), its 20 slowest last
#   make test-slow -> only the `slow` tests (tests/conftest.py lists the ones marked there, with why)
#   make test-all -> the whole suite, slow tests included, then the zoo sweep
#   make test-axolotl -> Axolotl 0.21 beside the venv (tests/requirements-axolotl.txt), then the Axolotl
#                  plugin's test, which trains the docs' YAML (CI's .ci/run runs it after make test)
#   make zoo    -> the registry zoo: every model type transformers maps to a training head, every
#                  treatment, plain and chunked head, remat.plan (tens of minutes; not in make test)
# torch is installed first and pinned to the local CPU wheel so that pip never
# resolves `torch>=2.6` to a multi-GB CUDA build on a CPU-only machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# the suite runs in this many processes (pytest-xdist; CI has 2 cores); TEST_WORKERS=0 runs it in one
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal
# the zoo sweep runs this many model processes at a time, each stopped after ZOO_TIMEOUT seconds
ZOO_WORKERS ?= 2
ZOO_TIMEOUT ?= 900

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"

# liger-kernel without its dependencies (no Triton, ~290 MB with nothing to run on a CPU): its Python is
# what tests/test_kernels.py checks remat's wiring against, imported under a Triton stub (tests/_triton_stub.py)
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[hf,plot,test]"
	$(BIN)/pip install -q --no-deps "liger-kernel==0.8.5"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/remat bench

test: install
	$(PYTEST) -m "not slow" --durations=20 tests

# Axolotl's packages go in a folder of their own on PYTHONPATH, not into the venv: the venv stays what
# make test ran on (bitsandbytes, wandb and numba come with Axolotl)
AXOLOTL_SITE := $(VENV)/axolotl-site
$(AXOLOTL_SITE)/.installed: $(VENV)/.installed tests/requirements-axolotl.txt
	$(BIN)/pip install -q --no-deps --ignore-requires-python --target $(AXOLOTL_SITE) -r tests/requirements-axolotl.txt
	touch $@

test-axolotl: $(AXOLOTL_SITE)/.installed
	PYTHONPATH=$(AXOLOTL_SITE) AXOLOTL_DO_NOT_TRACK=1 $(PYTEST) -p no:cacheprovider tests/test_axolotl.py

test-slow: install
	$(PYTEST) -m slow tests

test-all: install
	$(PYTEST) tests
	$(MAKE) zoo

zoo: install
	$(BIN)/python benchmarks/zoo_sweep.py --workers $(ZOO_WORKERS) --timeout $(ZOO_TIMEOUT) --out benchmarks/results/zoo

.PHONY: install demo test test-slow test-all test-axolotl zoo
