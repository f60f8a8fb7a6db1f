"""Checks that kmp's loss-scale state agrees across tf.distribute replicas.

kmp builds no distribution of its own: under any `tf.distribute` strategy the
optimizer agrees on one finite/non-finite decision per step (an all-reduce of
the per-gradient flags) and moves its single mirrored state once. This
module verifies that, on demand.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kmp import optimizer as optimizer_lib


class ReplicaDivergenceError(RuntimeError):
    """Replicas hold different loss-scale states."""


def verify_replicas(optimizer: optimizer_lib.LossScaleOptimizer) -> int:
    """Checks that every replica holds the same loss scale, counters and last
    decision; raises `ReplicaDivergenceError` naming what differs.

    Args:
        optimizer: A `kmp.LossScaleOptimizer`, used inside or outside a
            strategy.

    Returns:
        The number of replica copies compared (1 outside a strategy).

    Example:

    >>> opt = kmp.LossScaleOptimizer("sgd", mode="dynamic")
    >>> kmp.distribute.verify_replicas(opt)
    1
    """
    if not isinstance(optimizer, optimizer_lib.LossScaleOptimizer):
        raise TypeError(
            "verify_replicas() expects a kmp.LossScaleOptimizer. Received: "
            f"{optimizer!r} (of type {type(optimizer).__name__})."
        )
    names = optimizer_lib.STATE_NAMES
    copies = 1
    differing = []
    for name in names:
        variable = getattr(optimizer, name)
        value = variable.value if isinstance(variable, keras.Variable) else variable
        strategy = getattr(value, "_distribute_strategy", None) or (
            tf.distribute.get_strategy()
        )
        local = [
            keras.ops.convert_to_numpy(v).item()
            for v in strategy.experimental_local_results(value)
        ]
        copies = max(copies, len(local))
        if len(set(local)) > 1:
            differing.append(f"{name}: {local}")
    if differing:
        raise ReplicaDivergenceError(
            "Replicas disagree on the loss-scale state: "
            + "; ".join(differing)
            + ". Every replica must make the same skip decision. This is a bug "
            "in kmp or a variable created outside strategy.scope(): create the "
            "optimizer (and compile the model) inside the scope."
        )
    return copies
