"""Reading the graph being traced: whether it assigns a variable (Keras's
own loss-scale wrapper updates its scale in every train step, never in
evaluation), through TensorFlow's public graph API; and where values can be
read while it is traced."""

from __future__ import annotations

import contextlib
from typing import Any

import keras

# Ops that hand a variable's handle to code that may assign it: the assign
# itself, and the control-flow and function-call ops whose bodies (branches,
# loops, nested tf.functions) receive the handle as an input.
_ASSIGNING = frozenset(
    {
        "AssignVariableOp",
        "AssignAddVariableOp",
        "AssignSubVariableOp",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
        "While",
        "StatelessWhile",
        "PartitionedCall",
        "StatefulPartitionedCall",
    }
)


def building() -> bool:
    """Whether TensorFlow is building a graph (tracing a `tf.function`):
    False eagerly, and on other Keras backends."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.executing_eagerly()


def detached() -> Any:
    """A scope in which new variables are nodes of a graph of its own: they
    have shapes, dtypes and names, and hold no memory. TensorFlow only."""
    import tensorflow as tf

    return tf.Graph().as_default()


def persistent_tape() -> Any:
    """A persistent `tf.GradientTape`: several gradients of one loss
    (`kmp.debug.find_nonfinite`'s backward search). TensorFlow only."""
    import tensorflow as tf

    return tf.GradientTape(persistent=True)


def counter() -> Any:
    """A new int64 variable at 0, outside any model, that a traced step
    may add to (`assign_add`) and Python reads (`numpy()`). TensorFlow
    only."""
    import tensorflow as tf

    return tf.Variable(0, dtype=tf.int64, trainable=False)


def assigned_here(variable) -> bool:
    """Whether the graph being built assigns `variable`, or hands it to a
    branch, loop or nested function that may. Eagerly, with no graph to
    read, True."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return True
    graph = tf.compat.v1.get_default_graph()
    handle = getattr(getattr(variable, "value", None), "handle", None)
    if handle is None:
        handle = getattr(variable, "handle", None)
    inside = _inside(graph, handle)
    return any(
        op.type in _ASSIGNING and any(id(t) in inside for t in op.inputs)
        for op in graph.get_operations()
    )


def _inside(graph, handle) -> set[int]:
    """ids of the tensors that stand for `handle` in `graph`: the handle, and
    the placeholders a function graph captured it as (through every
    enclosing function graph, `outer_graph`)."""
    outer = getattr(graph, "outer_graph", None)
    ids = {id(handle)} if outer is None else _inside(outer, handle) | {id(handle)}
    return ids | {
        id(internal)
        for external, internal in getattr(graph, "captures", ())
        if id(external) in ids
    }


def init_scope() -> Any:
    """A scope where variables' values are read eagerly, also while a
    TensorFlow step is traced (`tf.init_scope`). On other Keras backends,
    none: kmp reads values there before the step, where they are."""
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.init_scope()
