"""`kmp.layers.lean_normalization`: a built model with kmp's batch and layer
normalization in place of Keras's."""

from __future__ import annotations

import keras

from kmp._base import warn as _warn
from kmp.internals import keras_private
from kmp.layers import batch_normalization
from kmp.layers import layer_normalization
from kmp.layers.batch_normalization import BatchNormalization
from kmp.layers.layer_normalization import LayerNormalization
from kmp.precision import policy as policy_lib

# Keras's classes, and kmp's that replace them.
_REPLACEMENTS = {
    keras.layers.BatchNormalization: BatchNormalization,
    keras.layers.LayerNormalization: LayerNormalization,
}


def lean_normalization(model: keras.Model) -> keras.Model:
    """A model that computes as `model` does, with its Keras
    `BatchNormalization` and `LayerNormalization` layers replaced by
    `kmp.layers.BatchNormalization` and `kmp.layers.LayerNormalization`.

    Under a 16-bit policy the replacements keep each normalization's 16-bit
    input for the backward pass where Keras's layers keep a float32 copy of
    it, so training holds less memory; the values computed are the same up
    to a 16-bit rounding of the output. Under float32 nothing changes.

    The model is rebuilt with Keras's `keras.models.clone_model`: each
    replacement takes its layer's config and weights (moving statistics
    included), and every other layer is the same object, with the same
    weights, in both models. Use the returned model from then on, and build
    on its graph (`new.input`, `new.output`): a shared layer's `.output` is
    the one of its first call, in `model`.

    Keras's own `Sequential` and Functional models are rebuilt, nested ones
    included. A model of another class (a subclassed model, or a subclass
    of `Sequential` or of a Functional model, such as KerasHub's models)
    would lose its class in the rebuild and is refused: use
    kmp's layers in its code. Normalization layers that
    cannot be replaced from outside (inside such a model or another
    subclassed layer nested in `model`, or of a subclass of Keras's layer)
    are left as they are, with a warning that names them.

    Args:
        model: A built `keras.Sequential` or Functional `keras.Model`, not
            compiled yet.

    Returns:
        The new model, or `model` itself if it has no Keras normalization
        layer to replace.

    Raises:
        TypeError: if `model` is not a Keras model.
        ValueError: if `model` is not of Keras's `Sequential` or Functional
            class, is not built, or is compiled (Keras's rebuild would
            compile the new model from the config, without kmp's loss
            scaling and with a fresh optimizer).

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
    if not keras_private.is_plain_graph_model(model):
        raise ValueError(
            "lean_normalization() rebuilds models of Keras's own Sequential "
            f"and Functional classes; {model.name!r} is a "
            f"{type(model).__name__}, which the rebuild would turn into a "
            "plain Sequential or Functional model, losing its code (its "
            "train_step, methods and attributes). Use "
            "kmp.layers.BatchNormalization and kmp.layers.LayerNormalization "
            "in place of Keras's in its code."
        )
    if not model.built:
        raise ValueError(
            f"lean_normalization() needs a built model; {model.name!r} is "
            "not built. Build it first (call it on a batch, or give it an "
            "Input)."
        )
    if model.compiled:
        raise ValueError(
            f"lean_normalization() takes a model before it is compiled; "
            f"{model.name!r} is compiled, and Keras's rebuild would compile "
            "the new model from its config, with a fresh optimizer and "
            "without kmp's loss scaling. Call lean_normalization() first, "
            "then kmp.compile the model it returns."
        )
    left: list[str] = []
    clone = _rebuilt(model, {}, left)
    left = list(dict.fromkeys(left))  # a layer reached twice is named once
    if left:
        _warn.warn(
            f"kmp.layers.lean_normalization left {len(left)} normalization "
            "layers as they were, each keeping a float32 copy of its 16-bit "
            f"input for the backward pass: {'; '.join(left)}. Use "
            "kmp.layers.BatchNormalization and kmp.layers.LayerNormalization "
            "in the code that creates them."
        )
    return clone


def _replaceable(layer) -> bool:
    return type(layer) in _REPLACEMENTS


def _rebuilt(model, made: dict, left: list[str]):
    """`model` rebuilt with kmp's normalization (`made`: the replacements
    so far, by the id of the layer replaced, so that a layer shared across
    nested models is replaced once), or `model` itself where nothing in it
    is replaced; what cannot be replaced is added to `left`."""
    replaced = []

    def replace(layer):
        if _replaceable(layer):
            if id(layer) not in made:
                kmp_class = _REPLACEMENTS[type(layer)]
                made[id(layer)] = kmp_class.from_config(layer.get_config())
                replaced.append((layer, made[id(layer)]))
            return made[id(layer)]
        if keras_private.is_plain_graph_model(layer):
            return _rebuilt(layer, made, left)
        left.extend(_left_inside(layer))
        return layer  # the same layer, shared with `model`

    if not any(map(_reaches_replaceable, model.layers)):
        for layer in model.layers:
            left.extend(_left_inside(layer))
        return model
    clone = keras.models.clone_model(model, clone_function=replace)
    for old, new in replaced:
        new.set_weights(old.get_weights())
    if not model.trainable:
        # Keras's rebuild of a Functional model leaves it trainable.
        keras_private.set_own_trainable(clone, False)
    return clone


def _reaches_replaceable(layer) -> bool:
    """Whether `layer` is, or holds through Keras's own graph models, a
    normalization `lean_normalization` replaces."""
    if _replaceable(layer):
        return True
    return keras_private.is_plain_graph_model(layer) and any(
        map(_reaches_replaceable, layer.layers)
    )


def _left_inside(layer) -> list[str]:
    """The normalizations in `layer` (itself included) that cannot be
    replaced from outside, each with the reason."""
    if _replaceable(layer) or not isinstance(layer, keras.layers.Layer):
        return []  # replaced, or an operation of the graph (`x + y`)
    if keras_private.is_plain_graph_model(layer):
        return [found for inner in layer.layers for found in _left_inside(inner)]
    found = []
    for norm in keras_private.sublayers(layer, include_self=True):
        if not _worth_naming(norm):
            continue
        if norm is layer:
            found.append(
                f"{norm.path!r} (of {type(norm).__name__}, a subclass of "
                "Keras's layer, whose code kmp would lose)"
            )
        else:
            found.append(
                f"{norm.path!r} (inside {layer.name!r}, a "
                f"{type(layer).__name__} whose own code creates it)"
            )
    return found


def _worth_naming(norm) -> bool:
    """Whether `norm`, left as it is, is a Keras normalization (or of a
    subclass) that may keep a float32 copy of a 16-bit input where kmp's
    layer would not: computing in a 16-bit policy, with settings kmp's
    layer computes (its input is not known here: a 16-bit policy is the
    sign)."""
    if not isinstance(norm, tuple(_REPLACEMENTS)) or isinstance(
        norm, tuple(_REPLACEMENTS.values())
    ):
        return False  # not a normalization, or kmp's already
    if norm.compute_dtype not in policy_lib.SIXTEEN_BIT:
        return False
    if isinstance(norm, keras.layers.BatchNormalization):
        return batch_normalization.fusable_settings(norm)
    return layer_normalization.fusable_settings(norm) and (
        len(layer_normalization.axes(norm)) == 1
    )
