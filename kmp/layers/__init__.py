"""Keras layers that keep less for the backward pass under a 16-bit policy:
`kmp.layers.BatchNormalization` and `kmp.layers.LayerNormalization` keep
their 16-bit input where Keras's keep a float32 copy, and
`kmp.layers.lean_normalization(model)` puts them in place of Keras's in a
built model."""

from kmp.layers.batch_normalization import BatchNormalization
from kmp.layers.layer_normalization import LayerNormalization
from kmp.layers.lean import lean_normalization

__all__ = ["BatchNormalization", "LayerNormalization", "lean_normalization"]
