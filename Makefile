# Two commands set up and run everything on a fresh machine:
#   make test   create .venv, install kmp with its test extra, lint, run the suite
#   make demo   create .venv, install kmp, run the main job (kmp demo)
# and one more:
#   make docs   build the documentation site (MkDocs) into site/
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
COMPILED := $(VENV)/.compiled
# What runs a second time, under Keras's JAX backend, where importing
# TensorFlow fails (conftest.py): the JAX tests and the test files that pass
# on either backend.
JAX_TESTS := tests/test_jax.py tests/test_policy.py tests/test_traversal.py \
	tests/test_layers.py tests/test_api.py

.PHONY: test demo lint docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# --no-compile: compiling every installed module ahead (most of TensorFlow
# is never imported here) took half of the install's time. What kmp, its
# demo and its suite import is compiled instead ($(COMPILED)), once, by
# importing it with bytecode written: where PYTHONDONTWRITEBYTECODE is set,
# nothing else writes it and every process compiled TensorFlow's Python
# again (import ~9 s against ~5 s).
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	touch $(STAMP)

$(COMPILED): $(STAMP)
	PYTHONDONTWRITEBYTECODE= TF_CPP_MIN_LOG_LEVEL=3 $(PY) -c "import kmp.tools.cli, \
	    keras_hub, sklearn.datasets, matplotlib.pyplot, pytest, xdist, hypothesis, jax"
	touch $(COMPILED)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site

# The suite runs on every core (pytest-xdist), test by test; tests that
# share a cached reference run on one worker (their xdist_group). Bytecode
# is written (into .venv and the tree's ignored __pycache__) so that what
# one of its processes compiles, the others do not compile again. Lint and
# the compile of what the suite imports take one core each, side by side.
# Then the JAX tests run once more under Keras's JAX backend, in one process
# with two host devices (for a two-device mesh), as where TensorFlow is not
# installed.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint $(COMPILED)
	PYTHONDONTWRITEBYTECODE= TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -n auto --dist loadgroup
	PYTHONDONTWRITEBYTECODE= TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=jax \
	    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
	    $(PY) -m pytest -q $(JAX_TESTS)

demo: $(COMPILED)
	TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/kmp demo

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site *.egg-info
