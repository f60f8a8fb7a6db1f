"""What the fused optimizer update (kmp.fused) buys, toward issue #5's
bfloat16 targets.

1. The update alone: Keras's Adam `apply` on the 3 x Dense(2048) MLP's
   12.6 M float32 weights, as Keras runs it (a tf.function of separate
   elementwise ops) and fused (the same `apply` under jit_compile=True).
2. End to end: a model's `fit` (the MLP unless --model) under float32,
   float32 with the fused update, mixed_bfloat16 with the update not fused,
   mixed_bfloat16 as `kmp.compile` sets it up (fused on a CPU), and
   mixed_bfloat16 with the whole step compiled by XLA (`jit_compile=True`,
   the alternative to fusing only the update); all through `kmp.compile`.

All variants in one process, interleaved (see _timing.py); CPU time by
default (steadier on shared cores), wall time with --clock wall.

Run: python benchmarks/fused_update.py [--repeats 5] [--clock cpu|wall]
     [--model mlp|cnn|transformer] [--skip-update-alone]
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import interleaved
from _timing import summary

import kmp
from kmp import bench
from kmp import fused


def update_alone(repeats: int, clock) -> dict:
    kmp.set_policy("float32")
    model, _ = bench.build_model("mlp")
    variables = model.trainable_variables
    grads = [tf.random.normal(v.shape) * 1e-3 for v in variables]
    runs = {}
    for name in ("keras", "fused"):
        opt = keras.optimizers.Adam(1e-3)
        opt.build(variables)
        if name == "keras":
            step = tf.function(lambda opt=opt: opt.apply(grads, variables))
        else:
            apply = fused.FusedApply(opt)
            step = tf.function(lambda apply=apply: apply(grads, variables))

        def run(step=step):
            for _ in range(10):
                step()

        runs[name] = run
    result = summary(interleaved(runs, repeats, clock), 10, "keras")
    result["weights"] = sum(int(v.numpy().size) for v in variables)
    return result


def end_to_end(
    model_name: str, repeats: int, steps: int, batch_size: int, clock
) -> dict:
    # Every variant goes through kmp.compile, so that only the policy and
    # the fusion differ: (policy, fused_update, jit_compile of the whole step).
    variants = {
        "float32": ("float32", False, False),
        "float32+fused": ("float32", True, False),
        "mixed_bfloat16 (update not fused)": ("mixed_bfloat16", False, False),
        "mixed_bfloat16 (kmp.compile)": ("mixed_bfloat16", None, False),
        "mixed_bfloat16 (whole step XLA)": ("mixed_bfloat16", False, True),
    }
    runs, first_call_s = {}, {}
    for name, (policy, fused_update, jit_compile) in variants.items():
        kmp.set_policy(policy)
        model, make = bench.build_model(model_name)
        kmp.compile(
            model,
            fused_update=fused_update,
            jit_compile=jit_compile,
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        x, y = make(steps * batch_size)
        start = time.perf_counter()  # tracing and (XLA) compiling included
        model.fit(x[:batch_size], y[:batch_size], verbose=0)
        first_call_s[name] = round(time.perf_counter() - start, 2)
        runs[name] = lambda m=model, x=x, y=y: m.fit(
            x, y, batch_size=batch_size, verbose=0
        )
    kmp.set_policy("float32")
    result = summary(interleaved(runs, repeats, clock), steps, "float32")
    result["first_call_wall_s"] = first_call_s
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument(
        "--model", choices=bench.BUILTIN_MODELS, default="mlp", help="end to end"
    )
    parser.add_argument(
        "--skip-update-alone", action="store_true", help="only the end-to-end part"
    )
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    result = {
        "benchmark": "fused_update",
        "model": args.model,
        "clock": args.clock,
        "update_alone": None
        if args.skip_update_alone
        else update_alone(args.repeats, clock),
        "end_to_end": end_to_end(
            args.model, args.repeats, args.steps, args.batch_size, clock
        ),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
