# Development entry points. `make test` and `make demo` set up .venv themselves (once; again only when
# pyproject.toml changes). On a GPU cluster install by hand instead: see README.md.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installed before the package so pip never pulls a CUDA build of torch onto a CPU machine.
# On a machine that already has the torch it wants, skip it: make test TORCH_SPEC=
TORCH_SPEC ?= torch==2.13.0
# Re-run the install when pyproject.toml is newer than this file.
STAMP := $(VENV)/.grpo-megatron-installed
# Folders git may not have yet (empty ones are not committed) are left out.
LINT_PATHS := $(wildcard grpo_megatron tests tools bench examples)

.PHONY: setup test demo lint clean distclean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

lint: setup
	$(BIN)/ruff check $(LINT_PATHS)

test: lint
	TORCH_COMPILE_DISABLE=1 $(BIN)/python -m pytest -q

# R1-Zero in miniature (examples/demo.yaml): cold-start SFT then GRPO on 2 processes; SEED=N for another seed.
SEED ?= 1234
demo: setup
	PYTHON=$(BIN)/python SEED=$(SEED) bash examples/demo.sh

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
