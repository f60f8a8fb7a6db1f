"""Keras layers that keep less for the backward pass under a 16-bit policy:
`kmp.layers.BatchNormalization` keeps its 16-bit input where Keras's keeps
a float32 copy, and `kmp.layers.lean_normalization(model)` puts it in place
of Keras's in a built model."""

from kmp.layers.batch_normalization import BatchNormalization
from kmp.layers.lean import lean_normalization

__all__ = ["BatchNormalization", "lean_normalization"]
