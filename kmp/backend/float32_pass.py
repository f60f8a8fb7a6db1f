"""A pass of a model with every layer in float32: what the model computes,
not what 16-bit makes of it (`kmp.backend.ranges`, `kmp.backend.underflow`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

from kmp.precision import quantization
from kmp.precision import traversal


@contextlib.contextmanager
def every_layer_in_float32(model: keras.layers.Layer) -> Iterator[None]:
    """Makes every layer of `model` compute in float32 (quantized layers keep
    their quantization) for the block, and restores their policies after
    it, also when it raises. Functions traced inside the block keep the
    float32 math; those traced before it do not see it."""
    saved = []
    try:
        for layer in [model] + [site.layer for site in traversal.walk(model)]:
            if layer.compute_dtype != "float32":
                saved.append((layer, quantization.snapshot(layer)))
                quantization.set_float_part(layer, "float32")
        yield
    finally:
        for layer, snapshot in reversed(saved):
            quantization.restore(layer, snapshot)
