"""`kmp.layers.LayerNormalization`: Keras's layer normalization, keeping a
16-bit input as it is for the backward pass."""

from __future__ import annotations

import keras
import tensorflow as tf

from kmp.backend import normalization


@keras.saving.register_keras_serializable(package="kmp")
class LayerNormalization(keras.layers.LayerNormalization):
    """Keras's `LayerNormalization`, keeping its 16-bit input as it is for the
    backward pass instead of a float32 copy.

    Keras's layer casts a float16 or bfloat16 input to float32 and computes
    from that copy, which the backward pass reads: each normalization keeps
    a float32 tensor the size of its input until the gradient is computed.
    This layer computes the same in float32 and keeps, for the backward
    pass, the 16-bit input and a float32 mean and inverse deviation per
    row; its gradient recomputes the normalized values from them, in
    float32.

    Everything else is Keras's layer: the same arguments, weights and
    `get_config`, so a model saved with it loads with `import kmp`. Where
    this computation does not apply, the layer computes as Keras's does:
    float32 inputs, weights that are not float32 (a pure 16-bit policy),
    `rms_scaling=True`, normalization over axes other than the last alone,
    or a last axis whose size is unknown when the call is traced.

    `kmp.layers.lean_normalization(model)` puts this layer in place of
    Keras's in a model that is built and not compiled yet.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> norm = kmp.layers.LayerNormalization()
    >>> norm(np.ones((4, 3), "float32")).dtype
    tf.bfloat16
    """

    def call(self, inputs):
        if not (_fusable_settings(self) and _over_last_axis(self, inputs)):
            return super().call(inputs)
        features = inputs.shape[-1]
        scale = (
            tf.convert_to_tensor(self.gamma)
            if self.scale
            else tf.ones([features], tf.float32)
        )
        offset = (
            tf.convert_to_tensor(self.beta)
            if self.center
            else tf.zeros([features], tf.float32)
        )
        outputs = normalization.layer_normalization(inputs, scale, offset, self.epsilon)
        return tf.cast(outputs, self.compute_dtype)


def _axes(layer: keras.layers.LayerNormalization) -> list[int]:
    return list(layer.axis) if isinstance(layer.axis, (list, tuple)) else [layer.axis]


def _over_last_axis(layer, inputs) -> bool:
    rank = inputs.shape.rank
    return (
        normalization.fusable(inputs, -1)
        and len(_axes(layer)) == 1
        and _axes(layer)[0] in (-1, rank - 1)
    )


def _fusable_settings(layer: keras.layers.LayerNormalization) -> bool:
    """Whether the layer's settings allow kmp's computation: no RMS scaling,
    float32 weights."""
    return not layer.rms_scaling and all(
        weight.dtype == "float32" for weight in layer.weights
    )


def keeps_float32_copy(layer: keras.layers.Layer) -> bool:
    """Whether `layer` is a built Keras `LayerNormalization` (not kmp's)
    that keeps a float32 copy of its 16-bit input for the backward pass,
    where `kmp.layers.LayerNormalization` with the same settings would keep
    the 16-bit input."""
    if not isinstance(layer, keras.layers.LayerNormalization) or isinstance(
        layer, LayerNormalization
    ):
        return False
    if layer.compute_dtype not in ("float16", "bfloat16") or not layer.built:
        return False
    # Keras keeps the axis as given (-1 by default), not the input's rank:
    # a last axis given by its number is not counted.
    return _fusable_settings(layer) and _axes(layer) == [-1]
