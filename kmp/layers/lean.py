"""`kmp.layers.lean_normalization`: a built model with kmp's batch
normalization in place of Keras's."""

from __future__ import annotations

import keras

from kmp._base import warn as _warn
from kmp.internals import keras_private
from kmp.layers.batch_normalization import BatchNormalization
from kmp.precision import traversal


def lean_normalization(model: keras.Model) -> keras.Model:
    """A model that computes as `model` does, with every Keras
    `BatchNormalization` layer replaced by `kmp.layers.BatchNormalization`.

    Under a 16-bit policy the replacement keeps each normalization's 16-bit
    input for the backward pass where Keras's layer keeps a float32 copy of
    it, so training holds less memory; the values computed are the same up
    to float32 rounding. Under float32 nothing changes.

    The model is rebuilt with Keras's `keras.models.clone_model`: each
    replacement takes its layer's config and weights (moving statistics
    included), and every other layer is the same object, with the same
    weights, in both models. Use the returned model from then on, and
    compile it (`kmp.compile`) as you would have compiled `model`: the
    optimizer of `model` does not carry over.

    Sequential and Functional models are rebuilt, nested ones included. A
    subclassed model cannot be rebuilt from outside: use
    `kmp.layers.BatchNormalization` in its code. Layers inside a subclassed
    layer of a Functional model are left as they are, with a warning that
    names them.

    Args:
        model: A built Sequential or Functional `keras.Model`.

    Returns:
        The new model, or `model` itself if it has no Keras
        `BatchNormalization` layer to replace.

    Raises:
        TypeError: if `model` is not a Keras model.
        ValueError: if `model` is not Sequential or Functional, or is not
            built.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = keras.Sequential([
    ...     keras.Input((8, 8, 3)),
    ...     keras.layers.Conv2D(4, 3),
    ...     keras.layers.BatchNormalization(),
    ... ])
    >>> model = kmp.layers.lean_normalization(model)
    >>> type(model.layers[1]).__module__
    'kmp.layers.batch_normalization'
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "lean_normalization() expects a keras.Model. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    if not traversal.is_graph(model):
        raise ValueError(
            f"lean_normalization() rebuilds Sequential and Functional "
            f"models; {model.name!r} is a subclassed model "
            f"({type(model).__name__}), which cannot be rebuilt from outside. "
            "Use kmp.layers.BatchNormalization in place of "
            "keras.layers.BatchNormalization in its code."
        )
    if not model.built:
        raise ValueError(
            f"lean_normalization() needs a built model; {model.name!r} is "
            "not built. Build it first (call it on a batch, or give it an "
            "Input)."
        )
    kept = _unreplaceable(model)
    if kept:
        _warn.warn(
            "kmp.layers.lean_normalization left these BatchNormalization "
            "layers as Keras's, keeping a float32 copy of their input for "
            "the backward pass: they sit in subclassed layers, whose code "
            f"creates them: {', '.join(kept)}. Use kmp.layers."
            "BatchNormalization in that code."
        )
    replaced = []

    def replace(layer):
        if type(layer) is not keras.layers.BatchNormalization:
            return layer  # the same layer, shared with `model`
        new = BatchNormalization.from_config(layer.get_config())
        replaced.append((layer, new))
        return new

    if not any(
        type(layer) is keras.layers.BatchNormalization
        for layer in _rebuilt_layers(model)
    ):
        return model
    clone = keras.models.clone_model(model, clone_function=replace, recursive=True)
    for old, new in replaced:
        new.set_weights(old.get_weights())
    return clone


def _rebuilt_layers(model):
    """The layers `clone_model(recursive=True)` hands to its clone function:
    those of `model` and of the Sequential and Functional models in it."""
    for layer in model.layers:
        yield layer
        if traversal.is_graph(layer):
            yield from _rebuilt_layers(layer)


def _unreplaceable(model) -> list[str]:
    """Paths of Keras BatchNormalization layers inside layers that are not
    Sequential or Functional models: their owners' code creates them."""
    found = []
    for layer in _rebuilt_layers(model):
        if traversal.is_graph(layer):
            continue
        for inner in keras_private.sublayers(layer):
            if type(inner) is keras.layers.BatchNormalization:
                found.append(inner.path)
    return found
