"""`kmp.layers.BatchNormalization`: Keras's batch normalization, keeping a
16-bit input as it is for the backward pass."""

from __future__ import annotations

import keras

from kmp.backend import distribute
from kmp.backend import normalization
from kmp.precision import policy as policy_lib


@keras.saving.register_keras_serializable(package="kmp")
class BatchNormalization(keras.layers.BatchNormalization):
    """Keras's `BatchNormalization`, keeping its 16-bit input as it is for the
    backward pass instead of a float32 copy.

    Keras's layer casts a float16 or bfloat16 input to float32 and computes
    from that copy, which the backward pass needs: each normalization keeps
    a float32 tensor the size of its input until the gradient is computed,
    twice what the 16-bit input takes. This layer computes the same in
    float32 (statistics, normalization, moving averages) through
    TensorFlow's fused batch normalization, which reads the 16-bit input
    itself and whose gradient needs only that input and one float32 value
    per channel.

    Everything else is Keras's layer: the same arguments, weights, moving
    statistics, `training` and `trainable` behaviour (a frozen layer
    normalizes with its moving statistics), and `get_config`, so a model
    saved with it loads with `import kmp` and keeps its weights. Where the
    fused computation does not apply, the layer computes as Keras's does:
    float32 inputs (nothing to save there; a layer whose policy computes in
    float32 gets its input cast to float32 before its call), weights that
    are not float32 (a pure 16-bit policy), a `mask`, `renorm`,
    `synchronized=True`, channels on an axis other than the last, or a
    number of channels unknown when the call is traced.

    `kmp.layers.lean(model, attention=False)` puts this layer in place of
    Keras's in a model that is built and not compiled yet.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> norm = kmp.layers.BatchNormalization()
    >>> y = norm(np.ones((4, 3), "float32"), training=True)
    >>> y.dtype, norm.moving_mean.dtype
    (tf.bfloat16, 'float32')
    """

    def call(self, inputs, training=None, mask=None):
        # The fused computation is TensorFlow's: on JAX the layer is Keras's.
        if keras.backend.backend() != "tensorflow":
            return super().call(inputs, training=training, mask=mask)
        if (
            mask is not None
            or not fusable_settings(self)
            or not normalization.fusable(inputs, self.axis)
        ):
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        scale, offset = normalization.scale_and_offset(self, channels)
        if training and self.trainable:
            outputs, mean, variance = normalization.batch_normalization(
                inputs, scale, offset, None, None, self.epsilon
            )
            momentum = self.momentum
            self.moving_mean.assign(
                self.moving_mean * momentum + mean * (1.0 - momentum)
            )
            self.moving_variance.assign(
                self.moving_variance * momentum + variance * (1.0 - momentum)
            )
        else:
            outputs, _, _ = normalization.batch_normalization(
                inputs,
                scale,
                offset,
                distribute.value(self.moving_mean),
                distribute.value(self.moving_variance),
                self.epsilon,
            )
        return keras.ops.cast(outputs, self.compute_dtype)


def fusable_settings(layer: keras.layers.BatchNormalization) -> bool:
    """Whether the layer's settings allow the fused computation: no
    renormalization, no synchronized statistics, float32 weights (the only
    type the fused kernel takes for them)."""
    return (
        not layer.renorm
        and not layer.synchronized
        and all(weight.dtype == "float32" for weight in layer.weights)
    )


def keeps_float32_copy(layer: keras.layers.Layer) -> bool:
    """Whether `layer` is a built Keras `BatchNormalization` (not kmp's)
    that keeps a float32 copy of its 16-bit input for the backward pass,
    where `kmp.layers.BatchNormalization` with the same settings would keep
    the 16-bit input."""
    if not isinstance(layer, keras.layers.BatchNormalization) or isinstance(
        layer, BatchNormalization
    ):
        return False
    if layer.compute_dtype not in policy_lib.SIXTEEN_BIT or not layer.built:
        return False
    rank = getattr(layer.input_spec, "ndim", None)
    return (
        fusable_settings(layer)
        and rank is not None
        and rank >= 2
        and layer.axis in (-1, rank - 1)
    )
