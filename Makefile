# `make demo` and `make test` each set up their own environment from a fresh clone.
#
# torch: on a machine with an NVIDIA driver, pip's default (CUDA) build; elsewhere TORCH_CPU_SPEC, which on
# our CPU machines resolves to the CPU wheel that lies on local disk (no multi-GB CUDA download).
# Override either, e.g. `make test TORCH_CPU_SPEC=torch`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mtrain-installed
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_GPU_SPEC ?= torch
PYTEST_ARGS ?=

.PHONY: setup demo test lint format clean

setup: $(STAMP)

# Python writes each module's bytecode the first time it is imported; later processes read it. Where the environment
# sets PYTHONDONTWRITEBYTECODE (our CI machines do), every process would compile torch and transformers again: the
# commands below run without it, and pip compiles nothing at install, most of which is never imported.
unexport PYTHONDONTWRITEBYTECODE

# torch and the rest in one pip call
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
		torch=; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		torch="$(TORCH_GPU_SPEC)"; \
	else \
		torch="$(TORCH_CPU_SPEC)"; \
	fi; \
	$(BIN)/python -m pip install --quiet --no-compile $${torch:+"$$torch"} -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mtrain demo

# one pytest worker per core (pytest-xdist): most tests wait on a process of their own or run one thread; a worker
# that runs out takes the other's waiting tests (worksteal), so a long test does not leave one worker idle
test: lint
	WANDB_MODE=disabled $(BIN)/python -m pytest -q -n auto --dist worksteal $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
