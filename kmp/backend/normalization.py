"""Batch normalization of a 16-bit tensor that keeps only the 16-bit tensor
for the backward pass.

Keras's `BatchNormalization` casts a 16-bit input to float32 and computes
from that copy; the backward pass needs the copy, so every normalization
keeps a float32 tensor the size of its input until the gradient is
computed: twice the memory of the 16-bit input, and in a convolutional
network most of what mixed precision was to save. TensorFlow's fused batch
normalization (`FusedBatchNormV3`) takes the 16-bit tensor itself with
float32 scale, offset and statistics, computes in float32 inside, and its
gradient reads the 16-bit input and per-channel float32 statistics only.
"""

from __future__ import annotations

import tensorflow as tf

SIXTEEN_BIT = (tf.float16, tf.bfloat16)


def fusable(x: tf.Tensor, axis: int) -> bool:
    """Whether `batch_normalization` computes this input: a 16-bit tensor
    of rank 2 or more whose channels are its last axis, their number
    known."""
    rank = x.shape.rank
    return (
        x.dtype in SIXTEEN_BIT
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
