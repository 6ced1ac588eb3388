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

.PHONY: venv venv-tf venv-mx test test-core test-tf test-mx demo bench lint clean gpu-wheels gpu-check

venv: $(STAMP)
venv-tf: $(TF_STAMP)
venv-mx: $(MX_STAMP)

# setuptools announces, in a framed page, that an editable install imports from this
# checkout: that is what a development environment is for.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

$(STAMP): $(DEPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(EDITABLE) $(BIN)/python -m pip install --quiet -e '.[dev,cuda,trainers]'
	touch $(STAMP)

$(TF_STAMP): $(DEPS)
	test -x $(TF_VENV)/bin/python || $(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(EDITABLE) $(TF_VENV)/bin/python -m pip install --quiet -e '.[dev,tf]'
	touch $(TF_STAMP)

# MXNet 1.9.1 imports only with NumPy 1.23.5, under HiPress's own floor: install the
# dependencies with that pin, then HiPress itself without its dependency list.
$(MX_STAMP): $(DEPS)
	test -x $(MX_VENV)/bin/python || $(PYTHON) -m venv $(MX_VENV)
	$(MX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MX_VENV)/bin/python -m pip install --quiet 'mxnet==1.9.1' 'numpy==1.23.5' \
		'torch==2.13.*' 'jinja2>=3.1' 'lark>=1.1.9,<2' 'rich>=13' matplotlib \
		scikit-learn 'pytest>=8'
	$(EDITABLE) $(MX_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(MX_STAMP)

test: test-core test-tf test-mx

test-core: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy --explicit-package-bases plugins  # plugins against casync.Engine
	$(BIN)/python -m pytest -q tests

test-tf: $(TF_STAMP)
	$(TF_VENV)/bin/python -m pytest -q tests/frameworks/test_tensorflow.py

test-mx: $(MX_STAMP)
	$(MX_VENV)/bin/python -m pytest -q tests/frameworks/test_mxnet.py

demo: $(STAMP)
	$(BIN)/hipress demo

bench: $(STAMP)
	$(BIN)/hipress bench kernels

# The device check runs on a GPU machine with torch (CUDA), nvcc and no network: lark,
# the one dependency missing there, travels as a wheel in .whl/ (make gpu-wheels, here);
# HiPress installs into GPU_SITE; the report goes to $$OUT (the device tool's) or
# bench/results/gpu-check. See bench/gpu_check.py.
GPU_SITE ?= /tmp/hipress-site
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux2014_x86_64 -d .whl 'lark>=1.1.9,<2'

gpu-check:
	$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) .whl/*.whl
	$(PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation --target $(GPU_SITE) .
	cd /tmp && PYTHONPATH=$(GPU_SITE) $(PYTHON) $(CURDIR)/bench/gpu_check.py \
		--out $${OUT:-$(CURDIR)/bench/results/gpu-check}

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy hipress_base hipress compll casync
	$(BIN)/mypy --explicit-package-bases plugins  # as plugins.torch, beside torch itself

clean:
	rm -rf $(VENV) $(TF_VENV) $(MX_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
