"""`kmp.layers.MultiHeadAttention`: Keras's multi-head attention, keeping
16-bit attention probabilities, not a float32 copy, for the backward pass."""

from __future__ import annotations

import keras

from kmp.layers.attention import lean_attention
from kmp.precision import kinds


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


# kmp's precision rules treat this layer as running Keras's attention code:
# it computes what Keras's code computes from the same sublayers' outputs.
kinds.register_attention_code(MultiHeadAttention)
