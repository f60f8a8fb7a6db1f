"""kmp under tf.distribute: one decision for all replicas.

kmp builds no distribution of its own: under any `tf.distribute` strategy the
optimizer agrees on one finite/non-finite decision per step (`agree`, an
all-reduce of the per-gradient flags), applies the step and moves its single
mirrored state once (`step_if_finite`); `kmp.debug.verify_replicas`
(`kmp.diagnostics.replicas`) checks that, on demand. This is the TensorFlow
edge of kmp's loss scaling. On other Keras backends there is no strategy:
`agree`, `in_multi_replica_context` and `check_build` have nothing to do
(JAX's finite check over sharded arrays is already global).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras


def agree(flags: Any):
    """ANDs boolean flags across the replicas of a tf.distribute strategy (an
    all-reduce SUM of the non-finite counts), so that every replica makes the
    same decision. Outside a multi-replica context it returns them unchanged.
    """
    if keras.backend.backend() != "tensorflow":
        return flags
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return flags
    bad = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(flags), tf.float32)
    )
    return tf.equal(bad, 0.0)


def value(variable: Any) -> Any:
    """`variable`'s value as a tensor, read as tf.distribute reads it (in a
    replica, that replica's copy; `float()` of it works under a strategy,
    where a distributed variable refuses it). On other Keras backends, its
    value."""
    if keras.backend.backend() != "tensorflow":
        return variable.value
    import tensorflow as tf

    return tf.convert_to_tensor(variable)


def colocated_with(variable: Any) -> Any:
    """A scope whose new variables are placed with `variable`, as Keras
    places its optimizers' slots: under a parameter-server strategy, on the
    variable's server. On other Keras backends, none."""
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    reference = variable.value if isinstance(variable, keras.Variable) else variable
    return tf.distribute.get_strategy().extended.colocate_vars_with(reference)


def replicas() -> int:
    """The number of replicas of the tf.distribute strategy in force (1
    without one, and on other Keras backends)."""
    if keras.backend.backend() != "tensorflow":
        return 1
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


def local_values(variable: Any) -> list:
    """Each replica's copy of `variable`'s value, as numbers: one outside a
    strategy (and on other Keras backends)."""
    if keras.backend.backend() != "tensorflow":
        return [keras.ops.convert_to_numpy(variable).item()]
    import tensorflow as tf

    value = variable.value if isinstance(variable, keras.Variable) else variable
    # A distributed variable's value names its strategy (public property of
    # tf.distribute's values); a plain one is in the default strategy.
    strategy = getattr(value, "distribute_strategy", None) or (
        tf.distribute.get_strategy()
    )
    return [
        keras.ops.convert_to_numpy(v).item()
        for v in strategy.experimental_local_results(value)
    ]


def under_strategy(model: Any) -> bool:
    """Whether `model` trains under a tf.distribute strategy: one in force,
    or one it was built in. False on other Keras backends."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return tf.distribute.has_strategy() or (
        model.distribute_strategy is not tf.distribute.get_strategy()
    )


def in_multi_replica_context() -> bool:
    """Whether code runs inside `strategy.run` with more than one replica."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    return (
        tf.distribute.has_strategy()
        and context is not None
        and context.num_replicas_in_sync > 1
    )


def check_build(inner_optimizer: Any) -> None:
    """Refuses to build a `kmp.LossScaleOptimizer` around `inner_optimizer`
    where the strategy in force cannot run it: inside `strategy.run` (once
    per replica), or with Keras's gradient accumulation on several
    replicas."""
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    if in_multi_replica_context():
        raise RuntimeError(
            "kmp.LossScaleOptimizer is being built inside strategy.run, once "
            "per replica, which cannot create one set of variables. Build it "
            "before the first strategy.run, inside strategy.scope(): "
            "optimizer.build(model.trainable_variables) (Keras's own "
            "LossScaleOptimizer needs the same)."
        )
    strategy = tf.distribute.get_strategy()
    if inner_optimizer.gradient_accumulation_steps and (
        strategy.num_replicas_in_sync > 1
    ):
        raise NotImplementedError(
            "Keras's gradient accumulation does not run under "
            f"{type(strategy).__name__} with more than one replica (its "
            "update sits in a condition, where the replicas' gradients "
            "cannot be all-reduced; plain Keras fails there too). Use a "
            "larger global batch instead of gradient_accumulation_steps, "
            "or train on one device."
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
    import tensorflow as tf

    from kmp.internals import tensorflow_private

    context = tf.distribute.get_replica_context()
    needs_merge = (
        context is not None
        and tf.distribute.has_strategy()
        and not tensorflow_private.strategy_supports_no_merge_call()
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
