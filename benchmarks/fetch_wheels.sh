#!/usr/bin/env bash
# Downloads the wheels benchmarks/gpu_jax.sh unpacks on a GPU machine with no
# network: Keras (the version this checkout's environment has) and the two
# small packages it needs that a JAX install lacks, namex and optree, for that
# machine's Python (PYTHON_VERSION, 3.12 by default) on x86-64 Linux, into
# benchmarks/wheels/ (about 3 MB; git ignores it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${PYTHON_VERSION:-3.12}
KERAS=$("$PY" -c "import importlib.metadata as m; print(m.version('keras'))")
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$VERSION" --platform manylinux2014_x86_64 \
  --dest benchmarks/wheels "keras==$KERAS" namex optree
ls -l benchmarks/wheels
