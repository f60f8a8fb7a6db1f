"""What kmp's attention layers (`kmp.layers.MultiHeadAttention`,
`GroupQueryAttention`) compute in place of Keras's code, and which of
Keras's attention layers keep the float32 copy they avoid."""

from __future__ import annotations

import math
from collections.abc import Callable

import keras

from kmp.backend import attention
from kmp.internals import keras_private
from kmp.precision import kinds
from kmp.precision import policy as policy_lib


def lean_attention(
    layer: keras.layers.Layer,
    query,
    key,
    value,
    attention_mask,
    keras_path: bool,
):
    """The output of a Keras attention layer's attention computed by
    `kmp.backend.attention.dot_product_attention`, or None where Keras's own
    code computes it: where the inputs promote to float32, `keras_path` (the
    caller asks for the scores, or Keras's causal kernel), dropout on the
    probabilities, projections of another rank than 4, flash attention,
    and on Keras's backends other than TensorFlow.

    Args:
        layer: The attention layer (`dropout` and flash attention are read).
        query, key, value: The projections, `[batch, length, heads, depth]`,
            key and value with as many heads as the query.
        attention_mask: Keras's boolean mask, `[batch or 1, queries, keys]`
            or `[batch or 1, heads or 1, queries, keys]`, or None.
        keras_path: Whether Keras's own code must compute it.

    The logits are scaled by one over the square root of the projections'
    depth, as Keras's layers scale them (`key_dim`, `head_dim`).
    """
    dtype = keras.backend.result_type(query.dtype, key.dtype, value.dtype)
    if (
        keras.backend.backend() != "tensorflow"
        or dtype not in policy_lib.SIXTEEN_BIT
        or keras_path
        or layer.dropout > 0.0
        or len(query.shape) != 4
        or keras_private.flash_attention(layer)
    ):
        return None
    if attention_mask is not None:
        attention_mask = keras.ops.cast(attention_mask, "bool")
        while len(attention_mask.shape) < 4:
            # [batch or 1, queries, keys] -> [batch or 1, 1, queries, keys]
            attention_mask = keras.ops.expand_dims(attention_mask, -3)
    query, key, value = (keras.ops.cast(t, dtype) for t in (query, key, value))
    scale = 1.0 / math.sqrt(float(query.shape[-1]))
    return attention.dot_product_attention(query, key, value, attention_mask, scale)


def keeps_float32_copy(
    layer: keras.layers.Layer,
    compute_dtype: Callable[[keras.layers.Layer], str] | None = None,
) -> bool:
    """Whether `layer` is a Keras `MultiHeadAttention` or
    `GroupQueryAttention` (not kmp's) that, as kmp's policies and rules
    have it compute, takes its softmax in float32 on 16-bit logits and keeps
    a float32 copy of its probabilities for the backward pass, where kmp's
    layer with the same settings would keep the 16-bit ones alone: Keras's
    attention code, 16-bit projections (all in one dtype), no dropout on the
    probabilities, and queries projected to rank 4 (one attention axis).
    Whether the caller asks for the scores (`return_attention_scores`) is
    not known here. `compute_dtype` gives each projection's compute dtype
    (kmp's plan, before it applies); by default, the one it has now."""
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
    if compute_dtype is None:

        def compute_dtype(projection: keras.layers.Layer) -> str:
            return projection.compute_dtype

    dtypes = {compute_dtype(projection) for projection in projections}
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
