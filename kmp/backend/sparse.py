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


def tensors(gradients: Any) -> list:
    """The tensors that gradients, as a step returns them, hold: a dense
    gradient itself, the rows and indices of an `IndexedSlices` (an
    embedding's); nothing for None."""
    held = []
    for gradient in gradients:
        if is_sparse(gradient):
            held += [gradient.values, gradient.indices]
        elif gradient is not None:
            held.append(gradient)
    return held


def map_values(gradient: Any, fn: Callable[[Any], Any]) -> Any:
    """A sparse `gradient` with `fn` applied to its rows, its indices kept."""
    import tensorflow as tf

    return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
