"""Does kmp's LossScaleOptimizer cost anything over Keras's own wrapper?

Trains the same model under `mixed_float16` with each wrapper, interleaved,
and reports ms/step of each and their ratio (see _timing.py for how).

Run: python benchmarks/loss_scale_overhead.py [--repeats 15] [--steps 30]
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _timing import interleaved
from _timing import summary

import kmp


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(512, activation="relu") for _ in range(3)]
        + [keras.layers.Dense(10)]
    )


def build(wrapper):
    kmp.set_policy("mixed_float16")
    model = mlp()
    inner = keras.optimizers.Adam(1e-3)
    if wrapper == "kmp":
        # Unfused, as Keras's wrapper applies it: this measures the scaling
        # machinery only (benchmarks/fused_update.py measures the fusion).
        optimizer = kmp.LossScaleOptimizer(inner, fused_update=False)
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data(steps, batch_size):
    rng = np.random.default_rng(0)
    n = steps * batch_size
    return rng.normal(size=(n, 512)).astype("float32"), rng.integers(0, 10, size=n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    # The float16 CPU slow path (grappler's MatMul+BiasAdd fusion, issue #5)
    # would make both ~50x slower and drown the comparison: off for both.
    tf.config.optimizer.set_experimental_options({"remapping": False})
    x, y = data(args.steps, args.batch_size)
    models = {name: build(name) for name in ("keras", "kmp")}
    runs = {
        name: (lambda m=m: m.fit(x, y, batch_size=args.batch_size, verbose=0))
        for name, m in models.items()
    }
    result = {"benchmark": "loss_scale_overhead"}
    result.update(summary(interleaved(runs, args.repeats), args.steps, "keras"))
    # Skipped steps are cheaper (no inner update): both must apply alike.
    result["applied_steps"] = {
        n: int(m.optimizer.iterations) for n, m in models.items()
    }
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
