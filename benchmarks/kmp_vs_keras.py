"""kmp's default path beside plain Keras, in one process: one built-in model
under one policy, trained with

- `keras`: `keras.config.set_dtype_policy` + `model.compile` (plain Keras),
- `kmp`: `kmp.set_policy` + `kmp.compile` (rules, fast paths, fused update,
  kmp's loss scaling where the model computes in float16),
- `kmp, update not fused`: the same with `fused_update=False`,

interleaved (see _timing.py), wall time by default. In one process the
variants share the machine's state, so their ratio is steadier than
`kmp bench --keras`, whose fresh processes differ by up to ~10% here. The
process-wide fast-path settings kmp applies under float16 (grappler's
remapper off on CPU-only machines) then hold for all three: compare plain
Keras's float16 with `kmp bench --keras` instead.

Run: python benchmarks/kmp_vs_keras.py [--model transformer]
     [--policy mixed_bfloat16] [--batch-size 64] [--repeats 7] [--clock wall|cpu]
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import CLOCKS
from _timing import add_clock_argument
from _timing import interleaved
from _timing import summary

import kmp
from kmp.tools import bench


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", choices=bench.BUILTIN_MODELS)
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    add_clock_argument(parser)
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    runs = {}
    for name in ("keras", "kmp", "kmp, update not fused"):
        if name == "keras":
            keras.config.set_dtype_policy(
                kmp.precision.policy.get(args.policy).keras_name
            )
        else:
            kmp.set_policy(args.policy)
        model, make = bench.build_model(args.model)
        optimizer = keras.optimizers.Adam(1e-3)
        if name == "keras":
            model.compile(optimizer=optimizer, loss=loss)
        else:
            fused = None if name == "kmp" else False
            kmp.compile(model, optimizer=optimizer, loss=loss, fused_update=fused)
        x, y = make(args.steps * args.batch_size)
        model.fit(x[: args.batch_size], y[: args.batch_size], verbose=0)
        runs[name] = lambda m=model, x=x, y=y: m.fit(
            x, y, batch_size=args.batch_size, verbose=0
        )
    result = {
        "benchmark": "kmp_vs_keras",
        "model": args.model,
        "policy": args.policy,
        "batch_size": args.batch_size,
        "clock": args.clock,
        "speed": summary(interleaved(runs, args.repeats, clock), args.steps, "keras"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
