"""`kmp.layers.MultiHeadAttention`: Keras's multi-head attention, keeping
16-bit attention probabilities, not a float32 copy, for the backward pass."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from kmp.backend import attention
from kmp.internals import keras_private
from kmp.precision import kinds
from kmp.precision import policy as policy_lib


@keras.saving.register_keras_serializable(package="kmp")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Keras's `MultiHeadAttention`, keeping its 16-bit attention
    probabilities for the backward pass instead of a float32 copy of them.

    Under a 16-bit policy Keras's layer computes the query-key logits in the
    compute dtype and the softmax in float32; the softmax's gradient reads
    that float32 output, so each attention layer keeps a float32 tensor of
    `[batch, heads, queries, keys]` values until the backward pass, beside
    the 16-bit probabilities. This layer computes the same values (the same
    operations in the same order) and keeps the 16-bit probabilities alone;
    its gradient computes the softmax's in float32 from them, which puts it
    within a 16-bit rounding of the probabilities of Keras's.

    Everything else is Keras's layer: the same arguments, weights, masks and
    `get_config`, so a model saved with it loads with `import kmp`. Where
    Keras's layer computes its attention another way, this layer does too
    (Keras's code runs): float32 attention (a float32 policy, or kmp's
    float32 attention scores rule under float16), dropout on the attention
    probabilities, `return_attention_scores=True`, more than one attention
    axis, and flash attention.

    `kmp.layers.lean(model)` puts this layer in place of Keras's in a model
    that is built and not compiled yet.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> attention = kmp.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> x = np.ones((1, 3, 8), "float32")
    >>> attention(x, x, use_causal_mask=True).dtype
    tf.bfloat16
    """

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
        # Keras's `call` hands a causal mask over as `attention_mask` to a
        # subclass that overrides this method; `use_causal_mask` stays False.
        output = lean_attention(
            self,
            query,
            key,
            value,
            attention_mask,
            use_causal_mask or return_attention_scores,
            1.0 / math.sqrt(float(self.key_dim)),
        )
        if output is None:
            return super()._compute_attention(
                query,
                key,
                value,
                attention_mask,
                training,
                return_attention_scores,
                use_causal_mask,
            )
        return output, None


def lean_attention(
    layer: keras.layers.Layer,
    query,
    key,
    value,
    attention_mask,
    keras_path: bool,
    scale: float,
):
    """The output of a Keras attention layer's attention computed by
    `kmp.backend.attention.dot_product_attention`, or None where Keras's own
    code computes it: where the inputs promote to float32, `keras_path` (the
    caller asks for the scores, or Keras's causal kernel), dropout on the
    probabilities, projections of another rank than 4, flash attention.

    Args:
        layer: The attention layer (`dropout` and flash attention are read).
        query, key, value: The projections, `[batch, length, heads, depth]`,
            key and value with as many heads as the query.
        attention_mask: Keras's boolean mask, `[batch or 1, queries, keys]`
            or `[batch or 1, heads or 1, queries, keys]`, or None.
        keras_path: Whether Keras's own code must compute it.
        scale: What the logits are multiplied by.
    """
    dtype = keras.backend.result_type(query.dtype, key.dtype, value.dtype)
    if (
        dtype not in ("float16", "bfloat16")
        or keras_path
        or layer.dropout > 0.0
        or len(query.shape) != 4
        or keras_private.flash_attention(layer)
    ):
        return None
    if attention_mask is not None:
        attention_mask = tf.cast(attention_mask, tf.bool)
        while attention_mask.shape.rank < 4:
            # [batch or 1, queries, keys] -> [batch or 1, 1, queries, keys]
            attention_mask = tf.expand_dims(attention_mask, -3)
    query, key, value = (tf.cast(t, dtype) for t in (query, key, value))
    return attention.dot_product_attention(query, key, value, attention_mask, scale)


# kmp's precision rules treat this layer as running Keras's attention code:
# it computes what Keras's code computes from the same sublayers' outputs.
kinds.register_attention_code(MultiHeadAttention)


def keeps_float32_copy(layer: keras.layers.Layer) -> bool:
    """Whether `layer` is a Keras `MultiHeadAttention` or
    `GroupQueryAttention` (not kmp's) that, as kmp's policies and rules now
    have it compute, takes its softmax in float32 on 16-bit logits and keeps
    a float32 copy of its probabilities for the backward pass, where kmp's
    layer with the same settings would keep the 16-bit ones alone: Keras's
    attention code, 16-bit projections (all in one dtype), no dropout on the
    probabilities, and queries projected to rank 4 (one attention axis).
    Whether the caller asks for the scores (`return_attention_scores`) is
    not known here."""
    keras_classes = (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)
    if not isinstance(layer, keras_classes) or isinstance(
        layer, tuple(kinds.registered_attention_code())
    ):
        return False
    if not layer.built or not kinds.keeps_keras_attention_code(layer):
        return False
    projections = [
        inner
        for inner in keras_private.sublayers(layer)
        if isinstance(inner, keras.layers.EinsumDense)
    ]
    dtypes = {projection.compute_dtype for projection in projections}
    # Keras's dot-product path needs queries projected to [batch, length,
    # heads, depth]: one attention axis (GroupQueryAttention has no other).
    one_axis = not isinstance(layer, keras.layers.MultiHeadAttention) or (
        len(layer.query_dense.equation.split("->")[-1]) == 4
    )
    return (
        len(dtypes) == 1
        and dtypes <= set(policy_lib.SIXTEEN_BIT)
        and layer.dropout == 0.0
        and one_axis
    )
