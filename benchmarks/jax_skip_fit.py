"""Where does kmp's float32 step lose time to plain Keras on JAX?

The bench's mlp (3 x Dense(2048), 12.6 M weights, Adam, batch 64) trained
by `fit` under float32, six ways, each in this process:

- keras:       `model.compile` with Keras's Adam, no skip;
- lso:         `kmp.LossScaleOptimizer` (mode 'none' at float32), as kmp
               trains: a finite check of every gradient value, then the
               update inside a `jax.lax.cond`;
- lso_sum:     the same, each gradient checked through its sum;
- lso_nocheck: the check replaced by a constant True (XLA removes the
               condition): what the check and the condition cost together;
- lso_nocond:  the check kept, the update applied whatever it says;
- lso_sum_nocond: both: a sum check and no condition.

Each way: a fresh model, one epoch of 20 steps to compile, then the best
of 3 epochs; the median over 5 rounds, ways interleaved.

Run: KERAS_BACKEND=jax python benchmarks/jax_skip_fit.py
"""

import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras

import kmp
from kmp.backend import finite
from kmp.backend.jax import step as step_lib
from kmp.tools import bench

WAYS = ("keras", "lso", "lso_sum", "lso_nocheck", "lso_nocond", "lso_sum_nocond")
CHECK, STEP = finite.finite_flags, step_lib.step_if_finite


def no_check(tensors):
    return keras.ops.ones((len(list(tensors)),), "bool")


def sum_check(tensors):
    return keras.ops.stack([keras.ops.isfinite(keras.ops.sum(t)) for t in tensors])


def no_cond(
    finite, apply, grads, variables, after, on_skip=None, record=None, *, state
):
    apply(grads, variables)
    after(finite)
    return finite


def ms_per_step(way: str) -> float:
    finite.finite_flags = (
        no_check if "nocheck" in way else sum_check if "sum" in way else CHECK
    )
    step_lib.step_if_finite = no_cond if "nocond" in way else STEP
    model, make = bench.build_model("mlp")
    x, y = make(64 * 20)
    optimizer = keras.optimizers.Adam(1e-3)
    if way != "keras":
        optimizer = kmp.LossScaleOptimizer(optimizer)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=64, verbose=0)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        model.fit(x, y, batch_size=64, verbose=0)
        times.append((time.perf_counter() - start) / 20 * 1000)
    return min(times)


def main() -> None:
    kmp.set_policy("float32")
    results = {way: [] for way in WAYS}
    for _ in range(5):
        for way in WAYS:
            results[way].append(ms_per_step(way))
    for way, times in results.items():
        print(f"{way}: {statistics.median(times):.1f} ms/step")


if __name__ == "__main__":
    main()
