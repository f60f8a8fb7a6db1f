"""The private Keras attributes kmp reads: a layer's sublayers, whether it
converts its inputs, a functional model's graph, the tracker that locks a
model's state, and the attention methods kmp's attention rule relies on.

Each accessor raises `InternalsChanged` where the installed Keras lacks what
it reads (checked once per attribute, on a layer Keras itself builds, so a
model that merely is not of the kind asked about is never mistaken for a
changed Keras).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import keras

from kmp.internals.changed import changed


def _check(obj: Any, name: str, consequence: str) -> None:
    if not hasattr(obj, name):
        raise changed("Keras", keras.__version__, f"`{name}`", consequence)


@functools.cache
def _probe_model() -> keras.Model:
    # A two-layer functional model, built once: what every Keras keeps on a
    # functional model and its tensors.
    inputs = keras.Input((1,), name="kmp_probe_input")
    return keras.Model(inputs, keras.layers.Dense(1, name="kmp_probe")(inputs))


def sublayers(
    layer: keras.layers.Layer, recursive: bool = True, include_self: bool = False
) -> list[keras.layers.Layer]:
    """The layers inside `layer` (`Layer._flatten_layers`, what Keras's own
    `Model.layers` reads), in Keras's order."""
    _check(layer, "_flatten_layers", "kmp cannot find the layers inside a layer")
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def converts_input_args(layer: keras.layers.Layer) -> bool:
    """Whether Keras casts `layer`'s floating-point input arguments to its
    compute dtype (`Layer._convert_input_args`; False for layers that take
    their inputs as they come)."""
    _check(
        layer,
        "_convert_input_args",
        "kmp cannot tell whether a layer casts its inputs",
    )
    return bool(layer._convert_input_args)


def graph_nodes(model: keras.layers.Layer) -> dict | None:
    """A functional model's nodes by depth (`Functional._nodes_by_depth`), or
    None for a model that is not a functional graph."""
    _check(
        _probe_model(), "_nodes_by_depth", "kmp cannot read a functional model's graph"
    )
    return getattr(model, "_nodes_by_depth", None)


def producer(tensor: Any) -> Any:
    """The operation (layer) that produced a symbolic tensor of a functional
    model (`KerasTensor._keras_history`)."""
    _check(
        _probe_model().output,
        "_keras_history",
        "kmp cannot tell which layer produced a tensor",
    )
    return tensor._keras_history.operation


def inbound_nodes(operation: Any) -> list:
    """The nodes where `operation` was called in functional graphs
    (`Operation._inbound_nodes`)."""
    _check(_probe_model().layers[-1], "_inbound_nodes", "kmp cannot walk a graph")
    return list(operation._inbound_nodes)


def build_shapes(model: keras.layers.Layer) -> dict:
    """The input shapes a model was built with (`Layer._build_shapes_dict`),
    `{}` where Keras recorded none."""
    _check(
        keras.layers.Dense(1),
        "_build_shapes_dict",
        "kmp cannot trace a built subclassed model",
    )
    return getattr(model, "_build_shapes_dict", None) or {}


@contextlib.contextmanager
def tracker_unlocked(model: keras.Model) -> Iterator[None]:
    """Lifts the lock Keras sets on a model's tracked state (`_tracker`;
    `Model.quantize` leaves it locked) for the body, and puts it back."""
    _check(model, "_tracker", "kmp cannot add its telemetry metric to a model")
    tracker = model._tracker
    locked = tracker is not None and getattr(tracker, "locked", False)
    if locked:
        tracker.unlock()
    try:
        yield
    finally:
        if locked:
            tracker.lock()


# What Keras's attention layers compute with, method by method: a subclass
# that overrides any of them runs its own attention code.
ATTENTION_METHODS = ("call", "_compute_attention", "_masked_softmax")


def attention_methods(base: type) -> tuple[Any, ...]:
    """`base`'s own attention methods (`ATTENTION_METHODS`), to compare with
    a subclass's."""
    for name in ATTENTION_METHODS:
        _check(base, name, "kmp cannot tell an attention subclass's own code")
    return tuple(getattr(base, name) for name in ATTENTION_METHODS)


def backing_variable(variable: Any) -> Any:
    """The backend variable inside a `keras.Variable` (`_value`); any other
    variable as it is."""
    if not isinstance(variable, keras.Variable):
        return variable
    _check(variable, "_value", "kmp cannot find a variable's handle")
    return variable._value
