"""The private TensorFlow functions kmp reads: whether op determinism is
enabled (TensorFlow has `tf.config.experimental.enable_op_determinism` but
no public getter; Keras reads the same function), and whether a strategy
applies updates without a merge call (`tf.__internal__`, as Keras's own
optimizers read it)."""

from __future__ import annotations

from kmp.internals.changed import changed


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is in force."""
    import tensorflow as tf

    try:
        from tensorflow.python.framework import config
    except ImportError as e:
        raise changed(
            "TensorFlow",
            tf.__version__,
            "`tensorflow.python.framework.config`",
            "kmp cannot tell whether op determinism is on, which decides "
            "whether the fused update may run",
        ) from e
    if not hasattr(config, "is_op_determinism_enabled"):
        raise changed(
            "TensorFlow",
            tf.__version__,
            "`tensorflow.python.framework.config.is_op_determinism_enabled`",
            "kmp cannot tell whether op determinism is on, which decides "
            "whether the fused update may run",
        )
    return bool(config.is_op_determinism_enabled())


def strategy_supports_no_merge_call() -> bool:
    """Whether the `tf.distribute` strategy in force applies updates in
    replica context, with no merge call."""
    import tensorflow as tf

    distribute = getattr(getattr(tf, "__internal__", None), "distribute", None)
    if not hasattr(distribute, "strategy_supports_no_merge_call"):
        raise changed(
            "TensorFlow",
            tf.__version__,
            "`tf.__internal__.distribute.strategy_supports_no_merge_call`",
            "kmp cannot tell whether a strategy needs a merge call to apply "
            "a step on every replica",
        )
    return bool(distribute.strategy_supports_no_merge_call())
