#!/usr/bin/env bash
# The kmp bench table on a GPU machine: mlp, cnn and transformer under
# float32, mixed_bfloat16 and mixed_float16, with GPU peak memory.
#
# Needs a Python with TensorFlow 2.21 (GPU build) that sees a GPU, and kmp
# installed from this repo (pip install -e .). Every model run is bounded
# (timeout), so the whole script ends within 8 minutes. Results (JSON) go to
# $OUT, or benchmarks/gpu-results/.
#
# Targets (issue #5): >= 2x step-time speed-up of the mixed policies over
# float32 on the transformer, and >= 40% less peak GPU memory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/gpu-results}
mkdir -p "$OUT"
if ! "$PY" -c 'import sys, tensorflow as tf; sys.exit(0 if tf.config.list_physical_devices("GPU") else 3)'; then
  echo "gpu.sh needs TensorFlow with a visible GPU (python: $PY)" >&2
  exit 3
fi
"$PY" -m kmp doctor --json > "$OUT/doctor.json"
for model in transformer mlp cnn; do
  echo "== $model" >&2
  # Written aside and moved into place only on success, so that a run that
  # failed or timed out leaves no half-written file for the summary.
  if timeout 140 "$PY" -m kmp bench --model "$model" --steps 20 --batch-size 256 \
      --rounds 2 --json > "$OUT/$model.json.part"; then
    mv "$OUT/$model.json.part" "$OUT/$model.json"
  else
    rm -f "$OUT/$model.json.part"
    echo "$model: timed out or failed" >&2
  fi
done
"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("*.json")):
    if path.name == "doctor.json":
        continue
    try:
        rows = json.loads(path.read_text())
    except ValueError:
        print(f"{path.stem}: unreadable results, skipped")
        continue
    base = next(r for r in rows if r["policy"] == "float32")
    for r in rows:
        saved = 1 - (r["peak_gpu_mb"] or 0) / (base["peak_gpu_mb"] or 1)
        target = ""
        if path.stem == "transformer" and r["policy"] != "float32":
            met = r["speedup_vs_float32"] >= 2.0 and saved >= 0.40
            target = "  target (>=2x, >=40% less memory): " + ("met" if met else "NOT met")
        print(f"{path.stem:12s} {r['policy']:15s} {r['median_step_ms']:8.2f} ms/step "
              f"{r['speedup_vs_float32']:.2f}x  peak GPU {r['peak_gpu_mb']} MB "
              f"({saved:.0%} less than float32){target}")
PYEOF
