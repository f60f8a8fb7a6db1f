"""Token ids carried by a float input: a layer that would cast them to 16-bit
before its Embedding (rounding ids above 256 or 2048), and a trace that
checks it still returns what it returned when it computes in float32."""

from __future__ import annotations

import keras

from kmp.backend import tracing
from kmp.internals import keras_private
from kmp.precision import policy as policy_lib
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


def returns_the_same_in_float32(layer, base: policy_lib.Policy) -> bool:
    """Whether `layer` returns the same dtypes in float32 as under `base`
    (one trace under each, the layer restored after)."""
    as_planned = tracing.output_dtypes(layer, base.keras_name)
    return bool(as_planned) and tracing.output_dtypes(layer, "float32") == as_planned
