"""Batch and layer normalization of a 16-bit tensor that keep the 16-bit
tensor, not a float32 copy, for the backward pass.

Keras's `BatchNormalization` casts a 16-bit input to float32 and computes
from that copy; the backward pass needs the copy, so every normalization
keeps a float32 tensor the size of its input until the gradient is
computed: twice the memory of the 16-bit input, and in a convolutional
network most of what mixed precision was to save. TensorFlow's fused batch
normalization (`FusedBatchNormV3`) takes the 16-bit tensor itself with
float32 scale, offset and statistics, computes in float32 inside, and its
gradient reads the 16-bit input and per-channel float32 statistics only.
Layer normalization has no such kernel: `layer_normalization` is a custom
gradient that keeps the 16-bit input and recomputes the rest from it in
float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # TensorFlow is imported where it is used
    import tensorflow as tf

SIXTEEN_BIT = ("float16", "bfloat16")


def scale_and_offset(layer, size: int) -> tuple[tf.Tensor, tf.Tensor]:
    """A Keras normalization layer's `gamma` and `beta` as float32 tensors,
    or ones and zeros of `size` where it has none (`scale=False`,
    `center=False`)."""
    import tensorflow as tf

    scale = (
        tf.convert_to_tensor(layer.gamma)
        if layer.scale
        else tf.ones([size], tf.float32)
    )
    offset = (
        tf.convert_to_tensor(layer.beta)
        if layer.center
        else tf.zeros([size], tf.float32)
    )
    return scale, offset


def fusable(x: tf.Tensor, axis: int) -> bool:
    """Whether `batch_normalization` computes this input: a 16-bit tensor
    of rank 2 or more whose channels are its last axis, their number
    known."""
    rank = x.shape.rank
    return (
        x.dtype.name in SIXTEEN_BIT
        and rank is not None
        and rank >= 2
        and axis in (-1, rank - 1)
        and x.shape[-1] is not None
    )


def batch_normalization(
    x: tf.Tensor,
    scale: tf.Tensor,
    offset: tf.Tensor,
    mean: tf.Tensor | None,
    variance: tf.Tensor | None,
    epsilon: float,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """`(y, mean, variance)`: `x` normalized over every axis but its last.

    Args:
        x: A 16-bit tensor, channels last (`fusable(x, -1)`).
        scale, offset: float32 (the only type the fused kernel takes for
            them), one value per channel.
        mean, variance: The float32 statistics to normalize with (inference),
            or both `None` to normalize with the batch's own (training).
        epsilon: Added to the variance.

    Returns:
        `y` in `x`'s dtype, and the statistics used, float32. The batch's
        variance is the biased one (divided by the count, not the count
        less one), as Keras's `BatchNormalization` computes it.
    """
    import tensorflow as tf

    channels = x.shape[-1]
    shape = tf.shape(x)
    # FusedBatchNormV3 takes 4-D NHWC; every axis but the channels' folds
    # into its batch axis, a reshape that copies nothing.
    x4 = tf.reshape(x, [-1, 1, 1, channels])
    training = mean is None
    if training:
        mean = variance = tf.zeros([0], tf.float32)
    y, used_mean, used_variance, *_ = tf.raw_ops.FusedBatchNormV3(
        x=x4,
        scale=scale,
        offset=offset,
        mean=mean,
        variance=variance,
        epsilon=epsilon,
        data_format="NHWC",
        is_training=training,
    )
    if training:
        # TensorFlow returns the unbiased variance of the batch.
        count = tf.cast(tf.shape(x4)[0], tf.float32)
        used_variance = used_variance * ((count - 1.0) / count)
    return tf.reshape(y, shape), used_mean, used_variance


def layer_normalization(
    x: tf.Tensor, scale: tf.Tensor, offset: tf.Tensor, epsilon: float
) -> tf.Tensor:
    """`x` normalized over its last axis, times `scale` plus `offset`,
    computed in float32 and returned in `x`'s dtype, with a gradient that
    keeps `x` as it is (16-bit) and recomputes the rest from it in float32.

    The forward pass is not recorded by gradient tapes (eagerly, a tape
    would otherwise keep every float32 intermediate of it); the gradient
    recomputes the statistics from `x`, so that a tape around it (a second
    derivative, a gradient penalty) differentiates them too.

    Args:
        x: A 16-bit tensor (`fusable(x, -1)`).
        scale, offset: float32, one value per feature of the last axis.
        epsilon: Added to the variance.
    """
    import tensorflow as tf

    def statistics(wide):
        mean, variance = tf.nn.moments(wide, axes=[-1], keepdims=True)
        return mean, tf.math.rsqrt(variance + epsilon)

    @tf.custom_gradient
    def normalize(x, scale, offset):
        wide = tf.cast(tf.stop_gradient(x), tf.float32)
        mean, inverse = statistics(wide)
        scale_, offset_ = tf.stop_gradient(scale), tf.stop_gradient(offset)
        y = tf.cast((wide - mean) * inverse * scale_ + offset_, x.dtype)

        def gradient(dy):
            dy = tf.cast(dy, tf.float32)
            # Recomputed once the gradient arrives: without the dependency,
            # the executor runs what depends on `x` alone during the forward
            # pass, and holds its float32 result until the backward pass.
            with tf.control_dependencies([dy]):
                wide = tf.cast(x, tf.float32)
            mean, inverse = statistics(wide)
            normalized = (wide - mean) * inverse
            batch_axes = list(range(x.shape.rank - 1))
            d_scale = tf.reduce_sum(dy * normalized, axis=batch_axes)
            d_offset = tf.reduce_sum(dy, axis=batch_axes)
            g = dy * scale
            dx = inverse * (
                g
                - tf.reduce_mean(g, axis=-1, keepdims=True)
                - normalized * tf.reduce_mean(g * normalized, axis=-1, keepdims=True)
            )
            return tf.cast(dx, x.dtype), d_scale, d_offset

        return y, gradient

    return normalize(x, scale, offset)
