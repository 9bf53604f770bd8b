# Two entry points for a fresh machine (see README):
#   make demo   -> venv, install, run remat's main job on the built-in CPU preset
#   make test   -> venv, install with test extras, run the test suite
# torch is installed first and pinned to the local CPU wheel so that pip never
# resolves `torch>=2.6` to a multi-GB CUDA build on a CPU-only machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# the suite runs in this many processes (pytest-xdist; CI has 2 cores); TEST_WORKERS=0 runs it in one
TEST_WORKERS ?= 2

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[hf,plot,test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/remat bench

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

.PHONY: install demo test
