"""float32 vs mixed_float16 vs mixed_bfloat16 `fit` on this CPU, with and
without grappler's remapper (its fused MatMul+BiasAdd kernels), in one
process, interleaved (see _timing.py). A first measurement toward issue #5.

Each variant's model is traced under its own remapper setting (the setting
applies to functions traced after it is set).

Run: python benchmarks/cpu_policies.py [--model mlp|cnn] [--repeats 5]
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _timing import interleaved
from _timing import summary

import kmp

# (name, policy, remapping forced after kmp.set_policy, or None: as kmp sets
# it, which is off for float16 on a CPU and on otherwise)
VARIANTS = (
    ("float32", "float32", None),
    ("mixed_float16", "mixed_float16", True),
    ("mixed_float16_no_remap", "mixed_float16", None),
    ("mixed_bfloat16", "mixed_bfloat16", None),
    ("mixed_bfloat16_no_remap", "mixed_bfloat16", False),
)


def build(kind):
    layers = keras.layers
    if kind == "mlp":  # 3 x Dense(2048), as in issue #5
        return keras.Sequential(
            [keras.Input((2048,))]
            + [layers.Dense(2048, activation="relu") for _ in range(3)]
            + [layers.Dense(10)]
        ), (2048,)
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.Conv2D(128, 3, strides=2, padding="same", activation="relu"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(10),
        ]
    ), (32, 32, 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    _, shape = build(args.model)
    rng = np.random.default_rng(0)
    n = args.steps * args.batch_size
    x = rng.random((n, *shape), dtype="float32")
    y = rng.integers(0, 10, n)
    runs = {}
    for name, policy, remap in VARIANTS:
        kmp.set_policy(policy)
        if remap is not None:
            tf.config.optimizer.set_experimental_options({"remapping": remap})
        keras.utils.set_random_seed(0)
        model, _ = build(args.model)
        kmp.compile(
            model,
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x[: args.batch_size], y[: args.batch_size], verbose=0)  # trace
        runs[name] = lambda m=model: m.fit(x, y, batch_size=args.batch_size, verbose=0)
    kmp.set_policy("float32")
    tf.config.optimizer.set_experimental_options({"remapping": True})
    result = {"benchmark": "cpu_policies", "model": args.model, "clock": "cpu"}
    result.update(
        summary(
            interleaved(runs, args.repeats, time.process_time), args.steps, "float32"
        )
    )
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
