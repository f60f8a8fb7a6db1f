"""`kmp.layers.GroupQueryAttention`: Keras's grouped-query attention, keeping
16-bit attention probabilities, not a float32 copy, for the backward pass."""

from __future__ import annotations

import keras

from kmp.internals import keras_private
from kmp.layers.attention import lean_attention
from kmp.precision import kinds


@keras.saving.register_keras_serializable(package="kmp")
class GroupQueryAttention(keras.layers.GroupQueryAttention):
    """Keras's `GroupQueryAttention`, keeping its 16-bit attention
    probabilities for the backward pass instead of a float32 copy of them.

    What `kmp.layers.MultiHeadAttention` does for Keras's multi-head
    attention: the same values (the same operations in the same order),
    with the softmax's gradient computed in float32 from the 16-bit
    probabilities, and Keras's own code wherever Keras's layer computes its
    attention another way (float32 attention, dropout,
    `return_attention_scores=True`, flash attention).

    `kmp.layers.lean(model)` puts this layer in place of Keras's in a model
    that is built and not compiled yet.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> attention = kmp.layers.GroupQueryAttention(
    ...     head_dim=4, num_query_heads=4, num_key_value_heads=2)
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
        use_causal_mask=False,
    ):
        # As for MultiHeadAttention: a causal mask comes as `attention_mask`;
        # `call` has repeated key and value to the query's heads.
        output = lean_attention(
            self,
            query,
            key,
            value,
            attention_mask,
            use_causal_mask or keras_private.returns_attention_scores(self),
        )
        if output is None:
            return super()._compute_attention(
                query, key, value, attention_mask, training, use_causal_mask
            )
        return output, None


# kmp's precision rules treat this layer as running Keras's attention code.
kinds.register_attention_code(GroupQueryAttention)
