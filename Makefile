# HiPress developer entry points. Every target creates or reuses the virtual
# environment itself, so `make demo` and `make test` work on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Reinstall only when the dependency files change.
DEPS   := pyproject.toml setup.py

.PHONY: venv test demo bench lint clean

venv: $(STAMP)

$(STAMP): $(DEPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/hipress demo

bench: $(STAMP)
	$(BIN)/hipress bench kernels

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy hipress compll casync

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
