#!/usr/bin/env bash
# The kmp bench table on Keras's JAX backend, on a GPU: the transformer and a
# ResNet-50 (random weights) under float32, mixed_bfloat16 and mixed_float16,
# kmp beside plain Keras, with the GPU's peak memory.
#
# Made for a machine with JAX (CUDA) but neither TensorFlow nor Keras, and no
# network. Keras and the two small packages it needs that such a machine
# lacks (namex, optree) come as wheels carried in benchmarks/wheels/
# (written by benchmarks/fetch_wheels.sh where there is a network); Keras's
# other dependencies (absl-py, rich, h5py, ml-dtypes, packaging) must be
# there, and the script names the one that is not. The wheels are unpacked
# into a scratch folder, which goes on PYTHONPATH with this checkout: kmp
# runs from it (pure Python) on the machine's own JAX; nothing is installed.
#
# Each policy of each model is one bounded run (timeout), so a slow one
# loses only its own row: at most 4 minutes for the transformer and 9 for
# ResNet-50. Run each model in a call of its own (MODELS=...) where a call
# may take 10 minutes at most.
# Results (JSON, one file per model and policy) go to $OUT, or
# benchmarks/gpu-results-jax/; nothing else is written there.
# Settings (environment): MODELS ("transformer resnet50"), POLICIES, STEPS,
# BATCH (per model: TRANSFORMER_BATCH, RESNET_BATCH), RESNET_SIZE (224),
# KERAS=0 (kmp alone), CPU=1 (run where JAX has no GPU: to try the script).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/gpu-results-jax}
WHEELS=${WHEELS:-benchmarks/wheels}
MODELS=${MODELS:-transformer resnet50}
POLICIES=${POLICIES:-float32,mixed_bfloat16,mixed_float16}
STEPS=${STEPS:-20}
RESNET_SIZE=${RESNET_SIZE:-224}
mkdir -p "$OUT"
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
export KERAS_BACKEND=jax
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import keras" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_jax.sh: no Keras here and no wheels in $WHEELS:" \
      "run benchmarks/fetch_wheels.sh where there is a network" >&2
    exit 3
  fi
  for wheel in "$WHEELS"/*.whl; do
    "$PY" -m zipfile -e "$wheel" "$SCRATCH/site"
  done
  export PYTHONPATH="$SCRATCH/site:$PYTHONPATH"
  "$PY" -c "import keras" || {
    echo "gpu_jax.sh: Keras from $WHEELS does not import (above: what is missing)" >&2
    exit 3
  }
fi
if [ "${CPU:-0}" != 1 ] && ! "$PY" -c \
    'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 3)'; then
  echo "gpu_jax.sh needs JAX with a visible GPU (python: $PY); CPU=1 runs it anyway" >&2
  exit 3
fi
keras_flag=--keras
[ "${KERAS:-1}" = 1 ] || keras_flag=
"$PY" -m kmp doctor --json > "$OUT/doctor.json"

for model in $MODELS; do
  echo "== $model" >&2
  case "$model" in
    resnet50)
      # Saved once, float32; kmp bench rebuilds it under each policy.
      spec="$SCRATCH/resnet50.keras"
      if ! timeout 120 "$PY" -c "import keras, sys; keras.applications.ResNet50(\
weights=None, input_shape=($RESNET_SIZE, $RESNET_SIZE, 3)).save(sys.argv[1])" "$spec"; then
        echo "resnet50: could not be built and saved" >&2
        continue
      fi
      batch=${BATCH:-${RESNET_BATCH:-64}} limit=140 ;;
    transformer) spec=transformer batch=${BATCH:-${TRANSFORMER_BATCH:-256}} limit=80 ;;
    *) spec=$model batch=${BATCH:-64} limit=80 ;;
  esac
  for policy in ${POLICIES//,/ }; do
    # Written aside and moved into place only on success, so that a run
    # that failed or timed out leaves no half-written file for the summary.
    part="$OUT/$model.$policy.json.part"
    if timeout "$limit" "$PY" -m kmp bench --model "$spec" --policies "$policy" \
        --steps "$STEPS" --batch-size "$batch" --rounds 1 $keras_flag \
        --keras-budget 0 --json > "$part"; then
      mv "$part" "${part%.part}"
    else
      rm -f "$part"
      echo "$model $policy: timed out or failed" >&2
    fi
  done
done

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
doctor = json.loads((out / "doctor.json").read_text())
gpus = [g.get("name") for g in doctor["gpus"]]
print("device:", ", ".join(gpus) if gpus else f"no GPU; CPU {doctor['cpu']['model']}")
print("versions:", doctor["versions"])
for path in sorted(out.glob("*.json")):
    if path.name == "doctor.json":
        continue
    try:
        rows = json.loads(path.read_text())
    except ValueError:
        print(f"{path.name}: unreadable results, skipped")
        continue
    for r in rows:
        step = r.get("median_step_ms")
        step = "failed" if step is None else f"{step:8.2f} ms/step"
        print(f"{path.stem.split('.')[0]:12s} {r['policy']:22s} {step}  "
              f"peak GPU {r.get('peak_gpu_mb')} MB  loss {r.get('final_loss')}")
PYEOF
