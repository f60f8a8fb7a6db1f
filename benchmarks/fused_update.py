"""What the fused optimizer update (kmp/backend/fused.py) buys, toward issue #5's
bfloat16 targets.

1. The update alone: Keras's Adam `apply` on the 3 x Dense(2048) MLP's
   12.6 M float32 weights, as Keras runs it (a tf.function of separate
   elementwise ops) and fused (the same `apply` under jit_compile=True).
2. End to end: a model's `fit` (the MLP unless --model) under float32,
   float32 with the fused update, mixed_bfloat16 with the update not fused
   and fused, and mixed_bfloat16 with the whole step compiled by XLA
   (`jit_compile=True`, the alternative to fusing only the update); all
   through `kmp.compile`. Each variant runs in a fresh process per round
   (rounds in alternating order), and is timed per step: the first step
   (tracing, XLA compiling) and the first step at a new batch size (a
   retrace) are reported apart from the steady state.

Part 1 runs its variants in one process, interleaved (see _timing.py), CPU
time by default (steadier on shared cores), wall time with --clock wall.

Run (from benchmarks/): python fused_update.py [--repeats 5] [--clock cpu|wall]
     [--rounds 2] [--steps 8] [--model mlp|cnn|transformer] [--skip-update-alone]
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import CLOCKS
from _timing import add_clock_argument
from _timing import cpu_model
from _timing import interleaved
from _timing import summary

import kmp
from kmp.backend import fused
from kmp.tools import bench


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


VARIANTS = {  # name: (policy, fused_update, jit_compile of the whole step)
    "float32": ("float32", False, False),
    "float32+fused": ("float32", True, False),
    "mixed_bfloat16 (update not fused)": ("mixed_bfloat16", False, False),
    "mixed_bfloat16 (update fused)": ("mixed_bfloat16", True, False),
    "mixed_bfloat16 (whole step XLA)": ("mixed_bfloat16", False, True),
}


def one_run(model_name: str, variant: str, steps: int, batch_size: int) -> dict:
    """One variant in this process (a fresh one, from end_to_end): every
    step's wall and CPU time, the first step (tracing and XLA compiling),
    and the first step at a new batch size (a retrace)."""
    policy, fused_update, jit_compile = VARIANTS[variant]
    kmp.set_policy(policy)
    model, make = bench.build_model(model_name)
    kmp.compile(
        model,
        fused_update=fused_update,
        jit_compile=jit_compile,
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = make((steps + 1) * batch_size)
    wall, cpu = [], []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            wall.append(1000 * (time.perf_counter() - self.start[0]))
            cpu.append(1000 * (time.process_time() - self.start[1]))

    model.fit(
        x, y, batch_size=batch_size, verbose=0, shuffle=False, callbacks=[Timer()]
    )
    first = wall[0]
    n = len(wall)
    half = batch_size // 2  # a new batch size: the step is traced again
    model.fit(x[:half], y[:half], batch_size=half, verbose=0, callbacks=[Timer()])
    return {
        "wall_ms": wall[1:n],
        "cpu_ms": cpu[1:n],
        "first_step_ms": first,
        "new_batch_size_step_ms": wall[n],
        "fused_functions": len(model.optimizer._fused_apply._functions),
    }


def end_to_end(model_name: str, rounds: int, steps: int, batch_size: int) -> dict:
    """Each variant in a fresh process per round, rounds in alternating
    order; medians over every timed step (the first step of a run is its
    tracing and compiling, reported apart)."""
    from kmp.tools import runs as _runs

    names = list(VARIANTS)
    runs = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(
                _runs.in_fresh_process(
                    "fused_update:one_run",
                    [model_name, name, steps, batch_size],
                    timeout=3600,
                    what=name,
                    show_output=False,
                )
            )

    def median(name, key):
        return statistics.median(v for run in runs[name] for v in run[key])

    base = median("float32", "wall_ms")
    return {
        "machine": cpu_model(),
        "rounds": rounds,
        "steps": steps,
        "batch_size": batch_size,
        "variants": {
            name: {
                "median_wall_ms": round(median(name, "wall_ms"), 1),
                "median_cpu_ms": round(median(name, "cpu_ms"), 1),
                "speedup_vs_float32": round(base / median(name, "wall_ms"), 3),
                "wall_ms_per_round": [
                    round(statistics.median(run["wall_ms"]), 1) for run in runs[name]
                ],
                "first_step_ms": [round(run["first_step_ms"]) for run in runs[name]],
                "new_batch_size_step_ms": [
                    round(run["new_batch_size_step_ms"]) for run in runs[name]
                ],
            }
            for name in names
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="update alone")
    parser.add_argument("--rounds", type=int, default=2, help="end to end")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    add_clock_argument(parser, default="cpu", help="update alone")
    parser.add_argument(
        "--model", choices=bench.BUILTIN_MODELS, default="mlp", help="end to end"
    )
    parser.add_argument(
        "--skip-update-alone", action="store_true", help="only the end-to-end part"
    )
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    result = {
        "benchmark": "fused_update",
        "model": args.model,
        "clock": args.clock,
        "update_alone": None
        if args.skip_update_alone
        else update_alone(args.repeats, clock),
        "end_to_end": end_to_end(args.model, args.rounds, args.steps, args.batch_size),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
