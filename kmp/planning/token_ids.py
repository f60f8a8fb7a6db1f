"""Token ids carried by a float input: a layer that would cast them to 16-bit
before its Embedding (rounding ids above 256 or 2048), and whether, read
from a trace, it still returns what it returned when it computes in
float32."""

from __future__ import annotations

import keras

from kmp.backend import tracing
from kmp.internals import keras_private
from kmp.precision import traversal


def rounds_token_ids(layer) -> bool:
    """A layer whose own code casts its float inputs to 16-bit and holds an
    Embedding (which reads float ids as they come)."""
    if traversal.is_graph(layer) or isinstance(layer, keras.layers.Embedding):
        return False
    if not (layer.autocast and keras_private.converts_input_args(layer)):
        return False
    return any(
        isinstance(inner, keras.layers.Embedding)
        for inner in keras_private.sublayers(layer)
    )


def passes_ids_on(traced: tracing.Forward, layer) -> bool:
    """Whether `layer`, computing in float32, still returns what it returns:
    its own code hands its inputs only to its sublayers (which keep their
    policies), read from the plan's trace of the model (`traced`)."""
    if traced.error:
        return False
    return tracing.input_only_feeds_sublayers(traced, layer)
