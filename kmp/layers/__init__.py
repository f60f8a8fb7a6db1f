"""Keras layers that keep less for the backward pass under a 16-bit policy.

`BatchNormalization` and `LayerNormalization` keep their 16-bit input where
Keras's keep a float32 copy. `MultiHeadAttention` and `GroupQueryAttention`
keep their 16-bit attention probabilities where Keras's keep a float32 copy
beside them. `lean(model)` puts them in place of Keras's in a built model.
Their lean computations are TensorFlow's: on Keras's JAX backend each
computes as Keras's own layer.
"""

from kmp.layers.batch_normalization import BatchNormalization
from kmp.layers.group_query_attention import GroupQueryAttention
from kmp.layers.layer_normalization import LayerNormalization
from kmp.layers.lean import lean
from kmp.layers.multi_head_attention import MultiHeadAttention

__all__ = [
    "BatchNormalization",
    "GroupQueryAttention",
    "LayerNormalization",
    "MultiHeadAttention",
    "lean",
]
