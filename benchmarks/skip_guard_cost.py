"""What does skipping non-finite steps cost per update, without loss scaling?

Under `mixed_bfloat16` and `float32`, `kmp.compile` wraps the optimizer in
a `kmp.LossScaleOptimizer` in mode `'none'`: no scaling, but a step whose
gradients hold an inf or NaN is skipped and counted. An end-to-end `fit`
comparison (loss_scale_overhead.py) sees this cost through +-10% noise;
this script isolates it: one compiled `apply` of fixed gradients to the
same MLP, timed per call, for

  keras      the plain Adam update (no check: what Keras does),
  check      the finite check computed beside the plain update (unused),
  cond       the plain update inside `tf.cond(all finite)`,
  kmp        kmp.LossScaleOptimizer(mode='none'): check, cond, counters.

Run: python benchmarks/skip_guard_cost.py [--repeats 15] [--calls 200]
     [--policy mixed_bfloat16|float32]
"""

import argparse
import json
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import interleaved
from _timing import summary
from loss_scale_overhead import mlp  # the same model as the fit comparison

import kmp


def update(kind, calls):
    """A callable that runs `calls` compiled updates of the given kind."""
    model = mlp()
    variables = model.trainable_variables
    inner = keras.optimizers.Adam(1e-3)
    if kind == "kmp":
        optimizer = kmp.LossScaleOptimizer(inner, mode="none", fused_update=False)
    else:
        optimizer = inner
    optimizer.build(variables)
    grads = [tf.random.normal(v.shape, seed=1) * 1e-3 for v in variables]

    def apply_plain():
        optimizer.apply(grads, variables)
        return tf.constant(True)

    @tf.function
    def step():
        if kind in ("keras", "kmp"):
            optimizer.apply(grads, variables)
        elif kind == "check":
            kmp.all_finite(grads)
            optimizer.apply(grads, variables)
        else:  # cond
            tf.cond(kmp.all_finite(grads), apply_plain, lambda: tf.constant(False))

    step()

    def run():
        for _ in range(calls):
            step()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--policy", choices=("mixed_bfloat16", "float32"), default="mixed_bfloat16"
    )
    args = parser.parse_args()
    kmp.set_policy(args.policy)
    kinds = ("keras", "check", "cond", "kmp")
    runs = {kind: update(kind, args.calls) for kind in kinds}
    times = interleaved(runs, args.repeats)
    result = {"benchmark": "skip_guard_cost", "policy": args.policy}
    result.update(summary(times, args.calls, "keras"))
    # Per update, in microseconds: rename so that the JSON says what it is.
    del result["best_ms_per_step"], result["median_ms_per_step"]
    for key, pick in (("best", min), ("median", statistics.median)):
        result[f"{key}_us_per_update"] = {
            k: round(1e6 * pick(v) / args.calls, 1) for k, v in times.items()
        }
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
