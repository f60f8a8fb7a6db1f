"""Sparse gradients: TensorFlow's `IndexedSlices`, the rows of an
`Embedding`'s gradient with their indices. Keras's other backends hand
dense gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras


def is_sparse(gradient: Any) -> bool:
    """Whether `gradient` is an `IndexedSlices` (never on other backends)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(gradient, tf.IndexedSlices)


def map_values(gradient: Any, fn: Callable[[Any], Any]) -> Any:
    """A sparse `gradient` with `fn` applied to its rows, its indices kept."""
    import tensorflow as tf

    return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
