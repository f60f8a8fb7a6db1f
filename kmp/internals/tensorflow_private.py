"""The private TensorFlow function kmp reads: whether op determinism is
enabled (TensorFlow has `tf.config.experimental.enable_op_determinism` but
no public getter; Keras reads the same function)."""

from __future__ import annotations

import tensorflow as tf

from kmp.internals.changed import changed


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is in force."""
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
