"""The private Keras attributes kmp reads: a layer's sublayers, whether it
converts its inputs, a functional model's graph, the input shapes a model
was built with, the tracker that locks a model's state, the attention
methods kmp's attention rule compares, whether an attention layer uses
flash attention or returns its scores, an optimizer's variables, the
backend variable inside a `keras.Variable`, a variable's path, the stack of
Keras's name scopes, the scope a mixed layer reads its variables in, whether
a model is of Keras's own graph classes, whether a layer defines its own
config, and a container's own trainable flag.

Each accessor raises `InternalsChanged` where the installed Keras lacks what
it reads. An attribute every object of a kind has is checked on the object
itself; one that only some objects have (a functional model's graph) is
checked on a probe Keras itself builds, so that a model that merely is not
of the kind asked about is never mistaken for a changed Keras.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import keras

from kmp.internals.changed import changed


def _check(obj: Any, name: str, consequence: str) -> None:
    if not hasattr(obj, name):
        raise changed("Keras", keras.__version__, f"`{name}`", consequence)


def _private(module: str, name: str, consequence: str) -> Any:
    """`name` from Keras's private `module`, or `InternalsChanged`."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise changed("Keras", keras.__version__, f"`{name}`", consequence) from e


def _flag(obj: Any, name: str, consequence: str) -> bool:
    """`obj`'s private attribute `name`, as a bool, once `_check`ed."""
    _check(obj, name, consequence)
    return bool(getattr(obj, name))


@functools.cache
def _probe_model() -> keras.Model:
    # A functional model of one weightless layer, built once: what every
    # Keras keeps on a functional model and its tensors. Everything in it is
    # named, so that it moves none of Keras's automatic names ('dense_1',
    # 'functional_1') of the user's layers and models, and it makes no
    # variables (it may first be needed while a step is traced).
    inputs = keras.Input((1,), name="kmp_probe_input")
    outputs = keras.layers.Identity(name="kmp_probe")(inputs)
    return keras.Model(inputs, outputs, name="kmp_probe_model")


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
    return _flag(
        layer, "_convert_input_args", "kmp cannot tell whether a layer casts its inputs"
    )


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
    consequence = "kmp cannot tell which layer produced a tensor"
    _check(_probe_model().output, "_keras_history", consequence)
    _check(_probe_model().output._keras_history, "operation", consequence)
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
        _probe_model().layers[-1],
        "_build_shapes_dict",
        "kmp cannot trace a built subclassed model",
    )
    return getattr(model, "_build_shapes_dict", None) or {}


@contextlib.contextmanager
def tracker_unlocked(model: keras.Model) -> Iterator[None]:
    """Lifts the lock Keras sets on a model's tracked state (`_tracker`;
    `Model.quantize` leaves it locked) for the body, and puts it back."""
    consequence = "kmp cannot add its telemetry metric to a model"
    _check(model, "_tracker", consequence)
    tracker = model._tracker
    if tracker is not None:
        _check(tracker, "locked", consequence)
    locked = tracker is not None and tracker.locked
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


def runs_attention_code_of(layer: keras.layers.Layer, base: type) -> bool:
    """Whether `layer` runs `base`'s own attention code: its class overrides
    none of `base`'s attention methods (`ATTENTION_METHODS`)."""
    for name in ATTENTION_METHODS:
        _check(base, name, "kmp cannot tell an attention subclass's own code")
    return all(
        getattr(type(layer), name) is getattr(base, name) for name in ATTENTION_METHODS
    )


def flash_attention(layer: keras.layers.MultiHeadAttention) -> bool:
    """Whether an attention layer was asked for flash attention
    (`MultiHeadAttention._flash_attention`: its `flash_attention` argument,
    or Keras's global switch when that is None)."""
    return _flag(
        layer,
        "_flash_attention",
        "kmp cannot tell whether an attention layer uses flash attention",
    )


def returns_attention_scores(layer: keras.layers.GroupQueryAttention) -> bool:
    """Whether a `GroupQueryAttention` layer's current call returns its
    scores (`GroupQueryAttention._return_attention_scores`, which its `call`
    sets for `_compute_attention` to read)."""
    return _flag(
        layer,
        "_return_attention_scores",
        "kmp cannot tell whether an attention layer returns its scores",
    )


def optimizer_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The trainable variables a built optimizer was built for
    (`Optimizer._trainable_variables`)."""
    _check(
        optimizer,
        "_trainable_variables",
        "kmp cannot find the variables a built optimizer updates",
    )
    return list(optimizer._trainable_variables)


def backing_variable(variable: Any) -> Any:
    """The backend variable inside a `keras.Variable` (`_value`); any other
    variable as it is."""
    if not isinstance(variable, keras.Variable):
        return variable
    _check(variable, "_value", "kmp cannot find a variable's handle")
    return variable._value


def with_path(variable: Any, path: str) -> Any:
    """`variable`, its path (`keras.Variable._path`, set from the name
    scopes it was made in) set to `path`: a stand-in that optimizers name
    and choose by as they would the variable it stands for."""
    _check(variable, "_path", "kmp cannot give a stand-in variable its path")
    variable._path = path
    return variable


@contextlib.contextmanager
def name_scopes_restored() -> Iterator[None]:
    """Leaves Keras's stack of name scopes (the `name_scope_stack` of
    `keras.src.backend.common.global_state`) as it found it, also where a
    scope failed to enter: Keras pushes a scope before TensorFlow, in a
    graph, refuses its name (one starting with `_`), and the scope is then
    never popped, so that every variable made after it is named under it."""
    global_state = _private(
        "keras.src.backend.common",
        "global_state",
        "kmp cannot keep Keras's name scopes as they were",
    )
    stack = global_state.get_global_attribute(
        "name_scope_stack", default=[], set_to_default=True
    )
    depth = len(stack)
    try:
        yield
    finally:
        del stack[depth:]


def is_plain_graph_model(model: Any) -> bool:
    """Whether `model` is a `keras.Sequential` or a Functional model of
    Keras's own class (`keras.Model(inputs, outputs)`), not of a subclass:
    what Keras's `clone_model` rebuilds as the class it was."""
    return type(model) is keras.Sequential or type(model) is type(_probe_model())


def has_own_config(layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s class defines `get_config` (Keras's own layers do),
    rather than relying on the config Keras makes from its constructor's
    plain arguments (`python_utils.default`, what Keras itself checks)."""
    is_default = _private(
        "keras.src.utils.python_utils",
        "is_default",
        "kmp cannot tell a layer's own config from Keras's automatic one",
    )
    return not is_default(layer.get_config)


def set_own_trainable(layer: keras.layers.Layer, value: bool) -> None:
    """Sets `layer.trainable` for the layer itself (`Layer._trainable`),
    leaving its sublayers' own flags as they are (the public setter sets
    every sublayer's too)."""
    _check(layer, "_trainable", "kmp cannot keep a rebuilt model frozen")
    layer._trainable = bool(value)


def autocast_scope(dtype: str | None) -> Any:
    """Keras's `AutocastScope(dtype)`, the scope a mixed layer's `call` runs
    in: float variables read inside it come back in `dtype` (as they are
    for None)."""
    scope = _private(
        "keras.src.backend",
        "AutocastScope",
        "kmp cannot read variables in float32 inside a float32 scope",
    )
    return scope(dtype)
