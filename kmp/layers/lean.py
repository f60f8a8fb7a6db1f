"""`kmp.layers.lean`: a built model with kmp's layers, which keep 16-bit
tensors for the backward pass, in place of Keras's, which keep float32
copies."""

from __future__ import annotations

import keras

from kmp._base import warn as _warn
from kmp.internals import keras_private
from kmp.layers import batch_normalization
from kmp.layers import layer_normalization
from kmp.layers.batch_normalization import BatchNormalization
from kmp.layers.group_query_attention import GroupQueryAttention
from kmp.layers.layer_normalization import LayerNormalization
from kmp.layers.multi_head_attention import MultiHeadAttention
from kmp.planning import applied
from kmp.precision import policy as policy_lib

# Keras's classes, and kmp's that replace them.
_NORMALIZATIONS = {
    keras.layers.BatchNormalization: BatchNormalization,
    keras.layers.LayerNormalization: LayerNormalization,
}
_ALL = {
    **_NORMALIZATIONS,
    keras.layers.MultiHeadAttention: MultiHeadAttention,
    keras.layers.GroupQueryAttention: GroupQueryAttention,
}


def lean(model: keras.Model, *, attention: bool = True) -> keras.Model:
    """A model that computes as `model` does, with its Keras
    `BatchNormalization`, `LayerNormalization`, `MultiHeadAttention` and
    `GroupQueryAttention` layers replaced by kmp's (`kmp.layers`).

    Under a 16-bit policy kmp's layers keep 16-bit tensors for the backward
    pass where Keras's keep float32 copies: each normalization keeps its
    16-bit input instead of a float32 copy of it, and each attention layer
    its 16-bit attention probabilities instead of a float32 copy beside
    them. Training holds less memory; the values computed are the same up to
    a 16-bit rounding (the normalizations' outputs, the attention's
    gradients). Under float32 nothing changes.

    The model is rebuilt with Keras's `keras.models.clone_model`: each
    replacement takes its layer's config and weights (moving statistics
    included), and the policies kmp set on it and its sublayers where the
    model was prepared (`kmp.prepare`), and every other layer is the same
    object, with the same weights, in both models. Use the returned model
    from then on, and build on its graph (`new.input`, `new.output`): a
    shared layer's `.output` is the one of its first call, in `model`.

    Keras's own `Sequential` and Functional models are rebuilt, nested ones
    included. A model of another class (a subclassed model, or a subclass
    of `Sequential` or of a Functional model, such as KerasHub's models)
    would lose its class in the rebuild and is refused: use kmp's layers in
    its code. Layers that cannot be replaced from outside (inside such a
    model or another subclassed layer nested in `model`, or of a subclass of
    Keras's layer) are left as they are, with a warning that names them.

    Args:
        model: A built `keras.Sequential` or Functional `keras.Model`, not
            compiled yet.
        attention: Whether the attention layers are replaced too. With
            `False`, only the normalizations are.

    Returns:
        The new model, or `model` itself if it has no Keras layer to
        replace.

    Raises:
        TypeError: if `model` is not a Keras model.
        ValueError: if `model` is not of Keras's `Sequential` or Functional
            class, is not built, or is compiled (Keras's rebuild would
            compile the new model from the config, without kmp's loss
            scaling and with a fresh optimizer).

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> tokens = keras.Input((16, 8))
    >>> x = keras.layers.MultiHeadAttention(2, 4)(tokens, tokens)
    >>> x = keras.layers.LayerNormalization()(x)
    >>> model = kmp.layers.lean(keras.Model(tokens, x))
    >>> [type(layer).__name__ for layer in model.layers[1:]]
    ['MultiHeadAttention', 'LayerNormalization']
    >>> type(model.layers[1]).__module__
    'kmp.layers.multi_head_attention'
    >>> convnet = keras.Sequential([
    ...     keras.Input((8, 8, 3)),
    ...     keras.layers.Conv2D(4, 3),
    ...     keras.layers.BatchNormalization(),
    ... ])
    >>> type(kmp.layers.lean(convnet, attention=False).layers[1]).__module__
    'kmp.layers.batch_normalization'
    """
    return _lean(model, _ALL if attention else _NORMALIZATIONS)


def _lean(model, replacements: dict) -> keras.Model:
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"lean() expects a keras.Model. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    if not keras_private.is_plain_graph_model(model):
        raise ValueError(
            f"lean() rebuilds models of Keras's own Sequential "
            f"and Functional classes; {model.name!r} is a "
            f"{type(model).__name__}, which the rebuild would turn into a "
            "plain Sequential or Functional model, losing its code (its "
            f"train_step, methods and attributes). Use {_kmp_names(replacements)} "
            "in place of Keras's in its code."
        )
    if not model.built:
        raise ValueError(
            f"lean() needs a built model; {model.name!r} is "
            "not built. Build it first (call it on a batch, or give it an "
            "Input)."
        )
    if model.compiled:
        raise ValueError(
            f"lean() takes a model before it is compiled; "
            f"{model.name!r} is compiled, and Keras's rebuild would compile "
            "the new model from its config, with a fresh optimizer and "
            f"without kmp's loss scaling. Call lean() first, "
            "then kmp.compile the model it returns."
        )
    left: list[str] = []
    clone = _Rebuild(replacements).rebuilt(model, left)
    left = list(dict.fromkeys(left))  # a layer reached twice is named once
    if left:
        _warn.warn(
            f"kmp.layers.lean left {len(left)} layers as they were, each "
            "keeping float32 copies of 16-bit tensors for the backward pass "
            f"where kmp's layer keeps the 16-bit ones: {'; '.join(left)}. Use "
            f"{_kmp_names(replacements)} in the code that creates them."
        )
    return clone


def _kmp_names(replacements: dict) -> str:
    names = [f"kmp.layers.{cls.__name__}" for cls in replacements.values()]
    return ", ".join(names[:-1]) + " and " + names[-1]


class _Rebuild:
    """One rebuild: Keras's layers of the classes in `replacements` replaced
    by kmp's, each once (`made`: the replacements so far, by the id of the
    layer replaced, so that a layer shared across nested models is replaced
    once)."""

    def __init__(self, replacements: dict):
        self.replacements = replacements
        self.made: dict = {}

    def replaceable(self, layer) -> bool:
        return type(layer) in self.replacements

    def rebuilt(self, model, left: list[str]):
        """`model` rebuilt, or `model` itself where nothing in it is
        replaced; what cannot be replaced is added to `left`."""
        replaced = []

        def replace(layer):
            if self.replaceable(layer):
                if id(layer) not in self.made:
                    kmp_class = self.replacements[type(layer)]
                    self.made[id(layer)] = kmp_class.from_config(layer.get_config())
                    replaced.append((layer, self.made[id(layer)]))
                return self.made[id(layer)]
            if keras_private.is_plain_graph_model(layer):
                return self.rebuilt(layer, left)
            left.extend(self.left_inside(layer))
            return layer  # the same layer, shared with `model`

        if not any(map(self.reaches_replaceable, model.layers)):
            for layer in model.layers:
                left.extend(self.left_inside(layer))
            return model
        clone = keras.models.clone_model(model, clone_function=replace)
        for old, new in replaced:
            new.set_weights(old.get_weights())
            applied.carry_over(old, new)
        if not model.trainable:
            # Keras's rebuild of a Functional model leaves it trainable.
            keras_private.set_own_trainable(clone, False)
        return clone

    def reaches_replaceable(self, layer) -> bool:
        """Whether `layer` is, or holds through Keras's own graph models, a
        layer this rebuild replaces."""
        if self.replaceable(layer):
            return True
        return keras_private.is_plain_graph_model(layer) and any(
            map(self.reaches_replaceable, layer.layers)
        )

    def left_inside(self, layer) -> list[str]:
        """The layers in `layer` (itself included) of the kinds this rebuild
        replaces that cannot be replaced from outside, each with the
        reason."""
        if self.replaceable(layer) or not isinstance(layer, keras.layers.Layer):
            return []  # replaced, or an operation of the graph (`x + y`)
        if keras_private.is_plain_graph_model(layer):
            return [
                found for inner in layer.layers for found in self.left_inside(inner)
            ]
        found = []
        for inner in keras_private.sublayers(layer, include_self=True):
            if not self.worth_naming(inner):
                continue
            if inner is layer:
                found.append(
                    f"{inner.path!r} (of {type(inner).__name__}, a subclass of "
                    "Keras's layer, whose code kmp would lose)"
                )
            else:
                found.append(
                    f"{inner.path!r} (inside {layer.name!r}, a "
                    f"{type(layer).__name__} whose own code creates it)"
                )
        return found

    def worth_naming(self, layer) -> bool:
        """Whether `layer`, left as it is, is of a Keras class this rebuild
        replaces (or of a subclass) and may keep a float32 copy of a 16-bit
        tensor where kmp's layer would not: computing in a 16-bit policy,
        with settings kmp's layer computes (its input is not known here: a
        16-bit policy is the sign)."""
        if not isinstance(layer, tuple(self.replacements)) or isinstance(
            layer, tuple(self.replacements.values())
        ):
            return False  # not of a kind replaced, or kmp's already
        if layer.compute_dtype not in policy_lib.SIXTEEN_BIT:
            return False
        if isinstance(layer, keras.layers.BatchNormalization):
            return batch_normalization.fusable_settings(layer)
        if isinstance(layer, keras.layers.LayerNormalization):
            return layer_normalization.fusable_settings(layer) and (
                len(layer_normalization.axes(layer)) == 1
            )
        # Attention: Keras's keeps its float32 probabilities where it has no
        # dropout on them.
        return layer.dropout == 0.0
