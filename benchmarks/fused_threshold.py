"""Where fusing the optimizer update starts to pay: kmp's optimizer around
Keras's Adam as `kmp.compile` sets it up without loss scaling (a step with
a non-finite gradient is skipped), its update not fused (`keras` below:
Keras's own update ops) and fused, for updates of 30 K to 10 M float32
weights spread over 8 or 64 variables. The first
call (tracing, and XLA compiling for the fused one) is reported apart.
This is the measurement behind the fused update's `MIN_WEIGHTS` (kmp/backend/fused.py).

All variants in one process, interleaved, best of `--repeats` runs of 20
applies each, wall time.

Run (from benchmarks/): python fused_threshold.py [--repeats 3]
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _timing import cpu_model

import kmp
from kmp.backend import fused

SIZES = (30_000, 100_000, 300_000, 1_000_000, 3_000_000, 10_000_000)
APPLIES = 20


def measure(total: int, n_variables: int, repeats: int) -> dict:
    size = total // n_variables
    variables = [
        keras.Variable(np.zeros((size,), "float32")) for _ in range(n_variables)
    ]
    grads = [tf.random.normal((size,)) * 1e-3 for _ in variables]
    per_apply: dict[str, list[float]] = {"keras": [], "fused": []}
    first: dict[str, list[float]] = {"keras": [], "fused": []}
    for _ in range(repeats):
        for name in ("keras", "fused"):
            # kmp's wrapper as kmp.compile sets it up without loss scaling
            # (the skip of non-finite steps included), unfused or fused.
            opt = kmp.LossScaleOptimizer(
                keras.optimizers.Adam(1e-3), mode="none", fused_update=name == "fused"
            )
            opt.build(variables)
            step = tf.function(lambda opt=opt: opt.apply(grads, variables))
            start = time.perf_counter()
            step()
            first[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(APPLIES):
                step()
            per_apply[name].append((time.perf_counter() - start) / APPLIES)
    keras_ms, fused_ms = (1000 * min(per_apply[k]) for k in ("keras", "fused"))
    return {
        "weights": size * n_variables,
        "variables": n_variables,
        "keras_ms": round(keras_ms, 3),
        "fused_ms": round(fused_ms, 3),
        "saved_ms": round(keras_ms - fused_ms, 3),
        "first_call_s": {k: round(min(v), 2) for k, v in first.items()},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [measure(t, n, args.repeats) for t in SIZES for n in (8, 64)]
    print(
        json.dumps(
            {
                "benchmark": "fused_threshold",
                "machine": cpu_model(),
                "cpus": os.cpu_count(),
                "min_weights": fused.MIN_WEIGHTS,
                "rows": rows,
                "tensorflow": tf.__version__,
                "keras": keras.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
