"""Does kmp's LossScaleOptimizer cost anything over Keras?

Under `mixed_float16` (the default): the same model with Keras's own
wrapper and with kmp's, interleaved. With `--policy mixed_bfloat16` or
`float32`: plain Keras (no wrapper: it applies non-finite steps) against
the path `kmp.compile` takes there, a `kmp.LossScaleOptimizer` in mode
`'none'` that only checks the gradients and skips non-finite steps. Both
unfused, so that this measures the checking alone; `--fused` gives kmp its
default update instead (fused by XLA on machines without GPUs or TPUs: the
path `kmp.compile` takes there). Reports ms/step of each and their ratio
(see _timing.py for how).

Run: python benchmarks/loss_scale_overhead.py [--repeats 15] [--steps 30]
     [--policy mixed_float16|mixed_bfloat16|float32] [--clock wall|cpu]
     [--fused]
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
from kmp.backend import fused


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(512, activation="relu") for _ in range(3)]
        + [keras.layers.Dense(10)]
    )


def build(wrapper, policy, fused):
    kmp.set_policy(policy)
    model = mlp()
    inner = keras.optimizers.Adam(1e-3)
    scaling = policy == "mixed_float16"
    if wrapper == "kmp":
        # Unfused unless --fused, as Keras applies it: this measures the
        # scaling and checking machinery only (benchmarks/fused_update.py
        # measures the fusion).
        mode = "dynamic" if scaling else "none"
        fused_update = None if fused else False
        optimizer = kmp.LossScaleOptimizer(inner, mode=mode, fused_update=fused_update)
    elif scaling:
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    else:
        optimizer = inner  # plain Keras under bfloat16 and float32
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
    parser.add_argument(
        "--policy",
        choices=("mixed_float16", "mixed_bfloat16", "float32"),
        default="mixed_float16",
    )
    add_clock_argument(parser)
    parser.add_argument(
        "--fused",
        action="store_true",
        help="kmp's default update (fused where that helps) instead of unfused",
    )
    args = parser.parse_args()
    # The float16 CPU slow path (grappler's MatMul+BiasAdd fusion, issue #5)
    # would make both ~50x slower and drown the comparison: off for both.
    tf.config.optimizer.set_experimental_options({"remapping": False})
    x, y = data(args.steps, args.batch_size)
    models = {name: build(name, args.policy, args.fused) for name in ("keras", "kmp")}
    runs = {
        name: (lambda m=m: m.fit(x, y, batch_size=args.batch_size, verbose=0))
        for name, m in models.items()
    }
    result = {"benchmark": "loss_scale_overhead", "policy": args.policy}
    clock = CLOCKS[args.clock]
    result["clock"] = args.clock
    kmp_optimizer = models["kmp"].optimizer
    result["kmp_fused"] = fused.resolve(
        kmp_optimizer.fused_update, kmp_optimizer.inner_optimizer
    )
    result.update(summary(interleaved(runs, args.repeats, clock), args.steps, "keras"))
    # Skipped steps are cheaper (no inner update): both must apply alike.
    result["applied_steps"] = {
        n: int(getattr(m.optimizer, "inner_optimizer", m.optimizer).iterations)
        for n, m in models.items()
    }
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
