"""What kmp's float32 attention scores cost under bfloat16, and what they
buy: the built-in transformer (2 blocks, d=256, sequence 128) trained under

- float32 (plain Keras),
- mixed_bfloat16, plain Keras (`model.compile`),
- mixed_bfloat16, `kmp.compile` (default rules: query/key projections,
  scores and softmax of MultiHeadAttention in float32),
- mixed_bfloat16, `kmp.compile` with
  `kmp.set_layer_policy(keras.layers.MultiHeadAttention, "mixed_bfloat16")`
  (the whole attention layer in bfloat16, as plain Keras does),

in one process, interleaved (see _timing.py), CPU time by default; and the
error of one MultiHeadAttention layer against float32 at input scales 1 to
30 under the three bfloat16 set-ups.

Run: python benchmarks/attention_rule.py [--repeats 3] [--batch-size 64]
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
from kmp import bench

# name: (policy, kmp.compile?, policy rule for MultiHeadAttention)
VARIANTS = {
    "float32": ("float32", False, None),
    "keras:mixed_bfloat16": ("mixed_bfloat16", False, None),
    "kmp:mixed_bfloat16": ("mixed_bfloat16", True, None),
    "kmp:mixed_bfloat16, attention in bfloat16": (
        "mixed_bfloat16",
        True,
        "mixed_bfloat16",
    ),
}


def prepared(policy, use_kmp, rule, build):
    kmp.set_policy(policy)
    if rule:
        kmp.set_layer_policy(keras.layers.MultiHeadAttention, rule)
    try:
        return build(use_kmp)
    finally:
        kmp.clear_layer_policies()


def speed(repeats: int, steps: int, batch_size: int, clock) -> dict:
    runs = {}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(use_kmp):
        model, make = bench.build_model("transformer")
        kwargs = dict(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        if use_kmp:
            kmp.compile(model, **kwargs)
        else:
            model.compile(**kwargs)
        return model, make

    for name, (policy, use_kmp, rule) in VARIANTS.items():
        model, make = prepared(policy, use_kmp, rule, build)
        x, y = make(steps * batch_size)
        model.fit(x[:batch_size], y[:batch_size], verbose=0)
        runs[name] = lambda m=model, x=x, y=y: m.fit(
            x, y, batch_size=batch_size, verbose=0
        )
    kmp.set_policy("float32")
    return summary(interleaved(runs, repeats, clock), steps, "float32")


def error() -> dict:
    def build(use_kmp):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((128, 256))
        layer = keras.layers.MultiHeadAttention(8, 32)
        model = keras.Model(inputs, layer(inputs, inputs))
        return kmp.prepare(model) if use_kmp else model

    reference = prepared("float32", False, None, build)
    models = {
        name: prepared(policy, use_kmp, rule, build)
        for name, (policy, use_kmp, rule) in VARIANTS.items()
        if name != "float32"
    }
    for model in models.values():
        model.set_weights(reference.get_weights())
    kmp.set_policy("float32")
    rng = np.random.default_rng(0)
    result = {}
    for scale in (1, 3, 10, 30):
        x = (rng.normal(size=(8, 128, 256)) * scale).astype("float32")
        want = reference(x).numpy()
        result[f"input scale {scale}"] = {
            name: round(
                float(
                    np.linalg.norm(np.asarray(model(x), "float32") - want)
                    / np.linalg.norm(want)
                ),
                4,
            )
            for name, model in models.items()
        }
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    result = {
        "benchmark": "attention_rule",
        "model": "transformer",
        "clock": args.clock,
        "relative_error_vs_float32": error(),
        "speed": speed(args.repeats, args.steps, args.batch_size, clock),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
