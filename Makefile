# HiPress developer entry points. Every target creates or reuses the virtual
# environment itself, so `make demo` and `make test` work on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Reinstall only when the dependency files change.
DEPS   := pyproject.toml setup.py

# TensorFlow and MXNet need NumPy versions that exclude each other: one venv each.
TF_VENV  := .venv-tf
TF_STAMP := $(TF_VENV)/.installed
MX_VENV  := .venv-mx
MX_STAMP := $(MX_VENV)/.installed

.PHONY: venv venv-tf venv-mx test test-core test-tf test-mx demo bench lint clean

venv: $(STAMP)
venv-tf: $(TF_STAMP)
venv-mx: $(MX_STAMP)

$(STAMP): $(DEPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,cuda]'
	touch $(STAMP)

$(TF_STAMP): $(DEPS)
	test -x $(TF_VENV)/bin/python || $(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TF_VENV)/bin/python -m pip install --quiet -e '.[dev,tf]'
	touch $(TF_STAMP)

# MXNet 1.9.1 imports only with NumPy 1.23.5, under HiPress's own floor: install the
# dependencies with that pin, then HiPress itself without its dependency list.
$(MX_STAMP): $(DEPS)
	test -x $(MX_VENV)/bin/python || $(PYTHON) -m venv $(MX_VENV)
	$(MX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MX_VENV)/bin/python -m pip install --quiet 'mxnet==1.9.1' 'numpy==1.23.5' \
		'torch==2.13.*' 'jinja2>=3.1' 'lark>=1.1.9,<2' 'rich>=13' matplotlib \
		scikit-learn 'pytest>=8'
	$(MX_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(MX_STAMP)

test: test-core test-tf test-mx

test-core: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

test-tf: $(TF_STAMP)
	$(TF_VENV)/bin/python -m pytest -q tests/frameworks/test_tensorflow.py

test-mx: $(MX_STAMP)
	$(MX_VENV)/bin/python -m pytest -q tests/frameworks/test_mxnet.py

demo: $(STAMP)
	$(BIN)/hipress demo

bench: $(STAMP)
	$(BIN)/hipress bench kernels

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy hipress compll casync

clean:
	rm -rf $(VENV) $(TF_VENV) $(MX_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
