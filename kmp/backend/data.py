"""What Keras's `fit` hands a train function on TensorFlow: a `tf.data`
iterator (a distributed one under a strategy), where `train_on_batch`
hands a generator. On JAX both hand generators."""

from __future__ import annotations

from typing import Any

import keras


def is_dataset_iterator(iterator: Any) -> bool:
    """Whether `iterator` is a `tf.data` iterator, as `fit` hands over on
    TensorFlow (False on other Keras backends)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator))


def input_shape(iterator: Any) -> Any:
    """The shape of the inputs a `tf.data` iterator yields, read from its
    `element_spec`: one shape, or a tuple of them for a tuple or list of
    tensors; None for anything else."""
    spec = getattr(iterator, "element_spec", None)
    if spec is None:
        return None
    import tensorflow as tf

    x, _, _ = keras.utils.unpack_x_y_sample_weight(spec)
    if isinstance(x, tf.TensorSpec):
        return tuple(x.shape)
    if isinstance(x, (tuple, list)) and all(isinstance(t, tf.TensorSpec) for t in x):
        return tuple(tuple(t.shape) for t in x)
    return None
