# Two commands set up and run everything on a fresh machine:
#   make test   create .venv, install kmp with its test extra, lint, run the suite
#   make demo   create .venv, install kmp, run the main job (kmp demo)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The suite runs on every core (pytest-xdist), a test file per worker.
test: lint
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -n auto --dist loadfile

demo: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/kmp demo

clean:
	rm -rf $(VENV) build *.egg-info
