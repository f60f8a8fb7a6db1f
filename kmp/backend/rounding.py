"""Rounding float32 to bfloat16: to nearest, or stochastically.

bfloat16 keeps float32's exponent and 8 of its 24 significand bits: a
float32 is a bfloat16 once its low 16 bits are zero. Rounding to nearest
loses every change smaller than half a bfloat16 step, and an exponential
moving average changes by a small fraction of its value per step (Adam's
second moment: by 0.1 %, a quarter of a bfloat16 step), so rounded to
nearest it stops moving. Stochastic rounding rounds up with the
probability of the distance to the lower neighbour: unbiased, so that the
average of many steps is kept (the method of torchao's bfloat16 AdamW).
It adds a uniform random 16-bit integer to the float32's bits and clears
the low 16 bits, drawn from a stateless generator with an explicit seed,
so that a step computes the same numbers eagerly, in a graph and under XLA.
"""

from __future__ import annotations

from typing import Any

ROUNDINGS = ("stochastic", "nearest")


def to_bfloat16(value: Any, rounding: str, seed: Any = None) -> Any:
    """`value` (float32) as bfloat16, rounded `rounding` (see the module
    docstring); `seed` (two integers) selects the random draw of
    `'stochastic'`.

    Example:

    >>> x = tf.fill([10000], 1.0 + 2.0**-9)  # a quarter bfloat16 step above 1
    >>> float(tf.reduce_mean(tf.cast(to_bfloat16(x, "nearest"), tf.float32)))
    1.0
    >>> rounded = to_bfloat16(x, "stochastic", seed=[0, 1])
    >>> sorted(set(tf.cast(rounded, tf.float32).numpy().tolist()))
    [1.0, 1.0078125]
    >>> abs(float(tf.reduce_mean(tf.cast(rounded, tf.float32))) - 1.0019531) < 3e-4
    True
    """
    import tensorflow as tf

    value = tf.convert_to_tensor(value, tf.float32)
    if rounding == "nearest":
        return tf.cast(value, tf.bfloat16)
    if rounding != "stochastic":
        raise ValueError(
            f"rounding must be one of {ROUNDINGS}. Received: {rounding!r}."
        )
    if seed is None:
        raise ValueError(
            "Stochastic rounding needs a seed (two integers) to select its "
            "random draw. Received: seed=None."
        )
    noise = tf.random.stateless_uniform(
        tf.shape(value), seed, minval=0, maxval=1 << 16, dtype=tf.int32,
        alg="philox",
    )  # fmt: skip
    bits = tf.bitwise.bitwise_and(
        tf.bitcast(value, tf.int32) + noise, tf.constant(-(1 << 16), tf.int32)
    )
    # Inf stays Inf (its low bits are zero), and a finite value above
    # bfloat16's largest may round up to Inf, as rounding up does. A NaN's
    # bits could carry into its sign or lose its payload: NaN is passed
    # through as it is.
    rounded = tf.bitcast(bits, tf.float32)
    rounded = tf.where(tf.math.is_nan(value), value, rounded)
    return tf.cast(rounded, tf.bfloat16)


def step_seed(seed: int, step: Any, stream: int) -> Any:
    """The seed of one step's draw for one stored value (`to_bfloat16`):
    the optimizer's `seed` and the `step` in one int64, the `stream` (which
    variable's which moment) in the other."""
    import tensorflow as tf

    return tf.stack(
        [
            tf.cast(seed, tf.int64) * (1 << 32) + tf.cast(step, tf.int64),
            tf.constant(stream, tf.int64),
        ]
    )
