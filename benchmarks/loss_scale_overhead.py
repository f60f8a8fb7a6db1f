"""Does kmp's LossScaleOptimizer cost anything over Keras's own wrapper?

Trains the same model under `mixed_float16` with each wrapper, interleaved
(kmp, keras, kmp, keras, ...) so that machine drift hits both alike, and
reports the median epoch time of each and their ratio.

Run: python benchmarks/loss_scale_overhead.py [--epochs 7] [--steps 60]
"""

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import kmp


def build(wrapper):
    keras.utils.set_random_seed(0)
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(512, activation="relu") for _ in range(3)]
        + [keras.layers.Dense(10)]
    )
    inner = keras.optimizers.Adam(1e-3)
    if wrapper == "kmp":
        optimizer = kmp.LossScaleOptimizer(inner)
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()

    # The float16 CPU slow path (grappler's MatMul+BiasAdd fusion) would make
    # both runs ~50x slower and drown the comparison; it is off for both.
    tf.config.optimizer.set_experimental_options({"remapping": False})
    rng = np.random.default_rng(0)
    n = args.steps * args.batch_size
    x = rng.normal(size=(n, 512)).astype("float32")
    y = rng.integers(0, 10, size=n)
    models = {name: build(name) for name in ("kmp", "keras")}
    times = {name: [] for name in models}
    for model in models.values():  # warm-up: tracing, first epoch
        model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
    order = list(models)
    for epoch in range(args.epochs):
        # ABBA order: neither wrapper always runs first.
        for name in order if epoch % 2 == 0 else order[::-1]:
            model = models[name]
            start = time.perf_counter()
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "benchmark": "loss_scale_overhead",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "steps_per_epoch": args.steps,
        "batch_size": args.batch_size,
        "epochs_timed": args.epochs,
        "median_epoch_s": {k: round(v, 4) for k, v in medians.items()},
        "ms_per_step": {k: round(1000 * v / args.steps, 2) for k, v in medians.items()},
        "kmp_over_keras": round(medians["kmp"] / medians["keras"], 4),
        # Skipped steps are cheaper (no inner update): both must apply alike.
        "applied_steps": {
            name: int(model.optimizer.iterations) for name, model in models.items()
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
