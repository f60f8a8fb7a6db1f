"""What kmp's attention scores modes cost under bfloat16, and what they buy:
the built-in transformer (2 blocks, d=256, sequence 128) trained under

- float32 (plain Keras),
- mixed_bfloat16, plain Keras (`model.compile`),
- mixed_bfloat16, `kmp.compile` with the default scores mode (`'auto'`:
  Keras's own attention under bfloat16),
- mixed_bfloat16, `kmp.compile` with `kmp.rules.set_attention_scores("float32")`
  (query/key projections, scores and softmax in float32),

in one process, interleaved (see _timing.py), CPU time by default; and the
error of one MultiHeadAttention layer against float32 at input scales 1 to
30 under the same set-ups.

With `--explore`, also each choice of sublayers one could put in float32
(query only, key only, query and key, query key and value), set by hand, to
show what each buys: the error at large inputs comes from rounding the
query *and* the key projections, so only set-ups that keep both unrounded
shrink it, and those two projections are what costs the time.

Run: python benchmarks/attention_rule.py [--repeats 3] [--batch-size 64] [--explore]
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _timing import CLOCKS
from _timing import add_clock_argument
from _timing import interleaved
from _timing import summary

import kmp
from kmp.tools import bench

F32 = "float32"
# name: (policy, kmp.compile?, scores mode or {sublayer attribute: policy})
VARIANTS = {
    "float32": ("float32", False, None),
    "keras:mixed_bfloat16": ("mixed_bfloat16", False, None),
    "kmp:mixed_bfloat16": ("mixed_bfloat16", True, "auto"),
    "kmp:mixed_bfloat16, scores float32": ("mixed_bfloat16", True, "float32"),
}
EXPLORE = {
    "keras + query float32": ("mixed_bfloat16", False, {"_query_dense": F32}),
    "keras + key float32": ("mixed_bfloat16", False, {"_key_dense": F32}),
    "keras + query, key float32": (
        "mixed_bfloat16",
        False,
        {"_query_dense": F32, "_key_dense": F32},
    ),
    "keras + query, key, value float32": (
        "mixed_bfloat16",
        False,
        {"_query_dense": F32, "_key_dense": F32, "_value_dense": F32},
    ),
}


def prepared(policy, use_kmp, setting, build):
    """Builds under `policy`; a string `setting` is kmp's scores mode, a
    dict sets attention sublayers' policies by hand (plain Keras)."""
    kmp.set_policy(policy)
    if isinstance(setting, str):
        kmp.rules.set_attention_scores(setting)
    try:
        model, *rest = build(use_kmp)
    finally:
        kmp.rules.set_attention_scores("auto")
    if isinstance(setting, dict):
        for layer in model._flatten_layers():
            if isinstance(layer, keras.layers.MultiHeadAttention):
                for attribute, sublayer_policy in setting.items():
                    getattr(layer, attribute).dtype_policy = sublayer_policy
    return (model, *rest)


def speed(variants, repeats: int, steps: int, batch_size: int, clock) -> dict:
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

    for name, (policy, use_kmp, setting) in variants.items():
        model, make = prepared(policy, use_kmp, setting, build)
        x, y = make(steps * batch_size)
        model.fit(x[:batch_size], y[:batch_size], verbose=0)
        runs[name] = lambda m=model, x=x, y=y: m.fit(
            x, y, batch_size=batch_size, verbose=0
        )
    kmp.set_policy("float32")
    return summary(interleaved(runs, repeats, clock), steps, "keras:mixed_bfloat16")


def error(variants) -> dict:
    def build(use_kmp):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((128, 256))
        layer = keras.layers.MultiHeadAttention(8, 32)
        # A layer after the attention, so that it is not the model's output
        # (an output follows the output rules, not the scores rule alone).
        outputs = keras.layers.Identity()(layer(inputs, inputs))
        model = keras.Model(inputs, outputs)
        return (kmp.prepare(model) if use_kmp else model,)

    (reference,) = prepared("float32", False, None, build)
    models = {
        name: prepared(policy, use_kmp, setting, build)[0]
        for name, (policy, use_kmp, setting) in variants.items()
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
    add_clock_argument(parser, default="cpu")
    parser.add_argument("--explore", action="store_true")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    variants = {**VARIANTS, **(EXPLORE if args.explore else {})}
    result = {
        "benchmark": "attention_rule",
        "model": "transformer",
        "clock": args.clock,
        "relative_error_vs_float32": error(variants),
        "speed": speed(variants, args.repeats, args.steps, args.batch_size, clock),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
