"""kmp under tf.distribute: one decision for all replicas, and a check that
they agree.

kmp builds no distribution of its own: under any `tf.distribute` strategy the
optimizer agrees on one finite/non-finite decision per step (`agree`, an
all-reduce of the per-gradient flags), applies the step and moves its single
mirrored state once (`step_if_finite`); `verify_replicas` checks that, on
demand. This is the TensorFlow edge of kmp's loss scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from kmp import loss_scale as ls


class ReplicaDivergenceError(RuntimeError):
    """Replicas hold different loss-scale states."""


def agree(flags: Any):
    """ANDs boolean flags across the replicas of a tf.distribute strategy (an
    all-reduce SUM of the non-finite counts), so that every replica makes the
    same decision. Outside a multi-replica context it returns them unchanged.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return flags
    bad = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(flags), tf.float32)
    )
    return tf.equal(bad, 0.0)


def in_multi_replica_context() -> bool:
    """Whether code runs inside `strategy.run` with more than one replica."""
    context = tf.distribute.get_replica_context()
    return (
        tf.distribute.has_strategy()
        and context is not None
        and context.num_replicas_in_sync > 1
    )


def step_if_finite(
    finite: Any,
    apply: Callable,
    grads: list,
    variables: list,
    after: Callable[[Any], None],
    on_skip: Callable[[Any], None] | None = None,
    record: Any = None,
):
    """Calls `apply(grads, variables)` only if `finite` (agreed on by every
    replica), else `on_skip(record)` (the overflow record: written only on
    skipped steps); then `after(finite)` (the state update); returns
    `finite`.

    Under a strategy that needs merge calls (Mirrored), the inner optimizer's
    apply, which all-reduces the gradients, cannot sit inside a condition in
    replica context; as Keras's own wrapper does, the condition and the state
    update then run once, in cross-replica context, and each replica applies
    inside it.
    """
    context = tf.distribute.get_replica_context()
    needs_merge = (
        context is not None
        and tf.distribute.has_strategy()
        and not tf.__internal__.distribute.strategy_supports_no_merge_call()
    )

    def skip(record):
        if on_skip is not None:
            on_skip(record)
        return tf.constant(False)

    if not needs_merge:

        def apply_now():
            apply(grads, variables)
            return tf.constant(True)

        tf.cond(finite, apply_now, lambda: skip(record))
        after(finite)
        return finite

    def cross_replica(distribution, grads, variables, finite, record):
        # Every replica agreed on `finite`: take the first replica's.
        finite = distribution.experimental_local_results(finite)[0]
        if record is not None:
            record = distribution.experimental_local_results(record)[0]

        def apply_now():
            distribution.extended.call_for_each_replica(apply, args=(grads, variables))
            return tf.constant(True)

        tf.cond(finite, apply_now, lambda: skip(record))
        after(finite)
        return finite

    return context.merge_call(cross_replica, args=(grads, variables, finite, record))


def verify_replicas(optimizer: Any) -> int:
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
    if not isinstance(getattr(optimizer, "loss_scale_object", None), ls.LossScale):
        raise TypeError(
            "verify_replicas() expects a kmp.LossScaleOptimizer. Received: "
            f"{optimizer!r} (of type {type(optimizer).__name__})."
        )
    state = optimizer.loss_scale_object.state
    copies = 1
    differing = []
    for field, name in ls.PUBLIC_NAMES.items():
        variable = getattr(state, field)
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
