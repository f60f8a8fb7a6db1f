"""What does skipping a non-finite step cost the optimizer update on JAX?

The update of the bench's mlp (3 x Dense(2048), Adam, 12.6 M weights), a
jitted `stateless_apply` with its state donated, three ways:

- adam:  Keras's Adam, no skip;
- cond:  `kmp.LossScaleOptimizer(mode="none")`, as kmp trains float32:
         the update inside a `jax.lax.cond` (`kmp.backend.jax.step`);
- where: the same, with both branches computed and each new value
         selected (`keras.ops.where`) instead of the condition.

Run: KERAS_BACKEND=jax python benchmarks/jax_skip_update.py adam|cond|where
(one variant per process; run them interleaved).
"""

import statistics
import sys
import time

import jax
import keras
import numpy as np

import kmp
from kmp.backend.jax import step as step_lib


def step_if_finite_by_select(
    finite, apply, grads, variables, after, on_skip=None, record=None, *, state
):
    """`step_lib.step_if_finite` with a select in place of the condition."""
    written = list({id(v): v for v in [*variables, *state]}.values())
    values = [v.value for v in written]

    def skip():
        if on_skip is not None:
            on_skip(record)

    applied = step_lib._pure(lambda: apply(grads, variables), written, values)()
    skipped = step_lib._pure(skip, written, values)()
    for variable, a, s in zip(written, applied, skipped, strict=True):
        variable.assign(keras.ops.where(finite, a, s))
    after(finite)
    return finite


def main(variant: str) -> None:
    if variant == "where":
        step_lib.step_if_finite = step_if_finite_by_select
    shapes = [(2048, 2048)] * 3 + [(2048, 10)]
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.random(s, "float32") * 0.01) for s in shapes]
    inner = keras.optimizers.Adam(1e-3)
    opt = inner if variant == "adam" else kmp.LossScaleOptimizer(inner, mode="none")
    opt.build(variables)
    grads = [rng.random(s, "float32") * 1e-3 for s in shapes]
    weights = [v.value for v in variables]
    slots = [v.value for v in opt.variables]
    update = jax.jit(
        lambda w, s, g: opt.stateless_apply(s, g, w), donate_argnums=(0, 1)
    )
    times = []
    for _ in range(40):
        start = time.perf_counter()
        weights, slots = update(weights, slots, grads)
        jax.block_until_ready(weights)
        times.append(time.perf_counter() - start)
    print(f"{variant}: {1000 * statistics.median(times[5:]):.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
