"""Dot-product attention of 16-bit tensors that keeps the 16-bit attention
probabilities, not a float32 copy of them, for the backward pass.

Keras's `dot_product_attention` (TensorFlow backend, the path
`MultiHeadAttention` takes without dropout or returned scores) computes the
query-key logits in the compute dtype, casts them to float32, and takes the
softmax in float32 before casting the probabilities back: the softmax's
gradient reads its float32 output, so every attention layer keeps a float32
tensor of its `[batch, heads, queries, keys]` probabilities until the
backward pass, beside the 16-bit probabilities the value product keeps: three
times the memory of the 16-bit probabilities alone. `dot_product_attention`
here computes the same ops in the same order and keeps the 16-bit
probabilities alone; its gradient computes the softmax's in float32 from
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # TensorFlow is imported where it is used
    import tensorflow as tf

# What Keras's masking puts in place of a masked float32 logit.
_MASKED_LOGIT = -0.7 * 3.38953e38


def dot_product_attention(
    query: tf.Tensor,
    key: tf.Tensor,
    value: tf.Tensor,
    mask: tf.Tensor | None,
    scale: float,
) -> tf.Tensor:
    """`softmax(scale * query·key + mask) · value` for 4-D `[batch, length,
    heads, depth]` tensors of one 16-bit dtype, as Keras's TensorFlow
    `dot_product_attention` computes it: logits in the 16-bit dtype, then
    scale, mask and softmax in float32, probabilities rounded to the 16-bit
    dtype for the value product.

    The backward pass reads the 16-bit probabilities (which the value
    product's gradient needs anyway) where Keras's reads a float32 copy of
    them too; the softmax's gradient is computed in float32 from them, one
    16-bit rounding of the probabilities away from Keras's. The gradient
    reads the forward pass's output as a differentiable tensor, so a tape
    around it (a gradient penalty) differentiates it a second time exactly.

    Args:
        query, key, value: `[batch, queries or keys, heads, depth]`, all in
            the same 16-bit dtype.
        mask: A boolean tensor that broadcasts to `[batch, heads, queries,
            keys]`, True where a query may attend to a key; or None.
        scale: What the logits are multiplied by (Keras: one over the square
            root of the depth).

    Returns:
        `[batch, queries, heads, depth]` in the inputs' dtype.
    """
    import tensorflow as tf

    logits = tf.einsum("BTNH,BSNH->BNTS", query, key, optimize="optimal")
    probabilities = _softmax(logits, mask, scale)
    return tf.einsum("BNTS,BSNH->BTNH", probabilities, value, optimize="optimal")


def _softmax(logits: tf.Tensor, mask: tf.Tensor | None, scale: float) -> tf.Tensor:
    """`softmax(scale * logits)` over the last axis, masked where `mask` is
    False, computed in float32 and returned in `logits`' dtype, with a
    gradient that reads that 16-bit result."""
    import tensorflow as tf

    forward = {}
    # Read here, not from `logits` in the gradient: eagerly, that would
    # hold the logits until the backward pass.
    dtype = logits.dtype

    @tf.custom_gradient
    def probabilities(logits):
        wide = tf.cast(tf.stop_gradient(logits), tf.float32) * scale
        if mask is not None:
            wide = tf.where(mask, wide, tf.constant(_MASKED_LOGIT, tf.float32))
        result = tf.cast(tf.nn.softmax(wide, axis=-1), logits.dtype)

        def gradient(d_result):
            d_wide = tf.cast(d_result, tf.float32)
            # The result as the caller received it: differentiable, so that a
            # tape around this gradient differentiates it through the softmax
            # again. Read once the gradient arrives: without the dependency,
            # the executor would cast it during the forward pass and hold the
            # float32 copy until the backward pass.
            with tf.control_dependencies([d_wide]):
                p = tf.cast(forward["result"], tf.float32)
            d_logits = p * (d_wide - tf.reduce_sum(d_wide * p, -1, keepdims=True))
            if mask is not None:
                # Keras's `where` passes no gradient to a masked logit (a row
                # masked whole is uniform, not zero, in the softmax).
                d_logits = tf.where(mask, d_logits, tf.zeros((), tf.float32))
            return tf.cast(d_logits * scale, dtype)

        return result, gradient

    forward["result"] = probabilities(logits)
    return forward["result"]
