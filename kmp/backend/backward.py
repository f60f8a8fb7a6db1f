"""Reading a step TensorFlow traces: whether gradients were computed there
by a tape's backward pass that never read the loss scale (the gradients of
a loss no one scaled). `kmp.scaling.unscaling` decides with it.

What it reads are TensorFlow internals: the backward pass's name scope,
the leaf op types, a function's captures, the outer graph of a loop body
or cond branch, and the inputs of a nested function's call. So it checks
its reading once per process on a tiny trace whose answers are known
(`misread_cases`).
"""

from __future__ import annotations

import functools
from typing import Any

import keras

from kmp.backend import graph as graph_lib
from kmp.backend import sparse
from kmp.internals import keras_private


def step_graphs() -> list:
    """The graph being built and those enclosing it, up to its function (a
    while-loop or cond body belongs to its function); [] when eager, and on
    JAX, which traces no TensorFlow graphs."""
    if keras.backend.backend() != "tensorflow":
        return []
    import tensorflow as tf

    if tf.executing_eagerly():
        return []
    graph = tf.compat.v1.get_default_graph()
    graphs = [graph]
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph
        graphs.append(graph)
    return graphs


def _handles(variable) -> set[int]:
    """ids of the resource handles a read of `variable` starts from (one per
    replica under a tf.distribute strategy)."""
    found = set()
    candidates = [variable, getattr(variable, "value", None)]
    values = getattr(variable, "values", None)
    if isinstance(values, (list, tuple)):
        candidates.extend(values)
    for candidate in candidates:
        if candidate is None:
            continue
        inner = keras_private.backing_variable(candidate)
        for v in [inner, *getattr(inner, "values", ())]:
            handle = getattr(v, "handle", None)
            if handle is not None:
                found.add(id(handle))
    return found


# TensorFlow's GradientTape builds every gradient op of a traced backward
# pass under this name scope (tensorflow/python/eager/backprop.py).
_BACKWARD_SCOPE = "gradient_tape/"
_LEAVES = ("Placeholder", "ReadVariableOp", "VarHandleOp", "Const")


def _from_a_backward_pass(tensor, source) -> bool:
    """Whether `tensor` is computed, in this trace, from the output of a
    tape's backward pass (an op in its name scope), before any leaf."""
    seen: set[int] = set()
    stack = [tensor]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        op = t.op
        if _BACKWARD_SCOPE in op.name:
            return True
        if op.type in _LEAVES:
            continue
        stack.extend(source(i) for i in op.inputs)
    return False


def computed_without_the_scale(grads, scale_variable) -> bool:
    """Whether every gradient is computed in this step's graphs by a tape's
    backward pass (not an argument, a captured value or a variable's value,
    nor computed from those alone) and none of them reads the loss scale
    (directly, or as an input of a call of another function): then they are
    the gradients of a loss no one scaled."""
    import tensorflow as tf

    # A walk over graphs in plain Python, which autograph must not convert.
    walk = tf.autograph.experimental.do_not_convert(_walk_without_the_scale)
    return walk(grads, scale_variable)


def _walk_without_the_scale(grads, scale_variable) -> bool:
    """`computed_without_the_scale`'s walk over the step's graphs."""
    graphs = step_graphs()
    tensors = sparse.tensors(grads)
    if not graphs or not tensors:
        return False
    in_step = {id(g) for g in graphs}
    # The handle's captures, from the outermost graph inwards; and the values
    # an inner graph (a loop or cond body) captured from an enclosing one.
    scale = _handles(scale_variable)
    outer_value = {}
    for graph in reversed(graphs):
        for external, internal in getattr(graph, "captures", ()):
            if id(external) in scale:
                scale.add(id(internal))
            if id(getattr(external, "graph", None)) in in_step:
                outer_value[id(internal)] = external

    def source(t):
        while id(t) in outer_value:
            t = outer_value[id(t)]
        return t

    for t in tensors:
        t = source(t)
        op = getattr(t, "op", None)
        if op is None or id(getattr(t, "graph", None)) not in in_step:
            return False
        if op.type == "Placeholder":
            return False  # handed into the function as a value
        if not _from_a_backward_pass(t, source):
            return False  # e.g. a value read from a variable, or an argument
    seen: set[int] = set()
    stack = [source(t) for t in tensors]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in scale:
            return False
        for inp in t.op.inputs:
            inp = source(inp)
            if id(inp) not in seen:
                stack.append(inp)
    return True


# What `computed_without_the_scale` must read in the self-check's trace.
_KNOWN_ANSWERS = {
    "a loss never scaled, in a function": True,
    "a loss times the scale, in a function": False,
    "gradients handed in as an argument": False,
    "a loss never scaled, in a loop body": True,
    "a loss times the scale, in a loop body": False,
    "a loss never scaled, in a cond branch": True,
    "a loss times the scale, in a cond branch": False,
    "a loss times the scale in a nested function": False,
}


@functools.cache
def misread_cases() -> tuple[str, ...]:
    """The self-check: the cases of a tiny trace, with known answers, that
    `computed_without_the_scale` reads wrongly on this TensorFlow.

    That function reads TensorFlow internals: the backward pass's name
    scope, the leaf op types, a function's captures, the outer graph of a
    loop body or cond branch, and the inputs of a nested function's call.
    This checks them once per process, the first time kmp needs them, so
    that a TensorFlow that changed one makes kmp raise, never divide.

    The trace is built in a graph of its own, so the caller's trace,
    strategy and name scopes are left as they are. It is traced, never run.

    Returns:
        The cases read wrongly, each with what was read; empty where all
        are right.
    """
    import tensorflow as tf

    read: dict[str, Any] = {}
    try:
        with graph_lib.detached():
            w = tf.Variable(3.0)
            scale = keras.Variable(1024.0)  # as the optimizer's is

            @tf.function(autograph=False)
            def times_scale(loss):
                return loss * scale

            def read_gradients(case: str, scaled: bool, nested: bool = False):
                with tf.GradientTape() as tape:
                    loss = w * w
                    if nested:
                        loss = times_scale(loss)
                    elif scaled:
                        loss = loss * scale
                grads = tape.gradient(loss, [w])
                read[case] = computed_without_the_scale(grads, scale)

            def cond_branch():
                read_gradients("a loss never scaled, in a cond branch", False)
                read_gradients("a loss times the scale, in a cond branch", True)
                return tf.constant(0)

            def loop_body(i):
                read_gradients("a loss never scaled, in a loop body", False)
                read_gradients("a loss times the scale, in a loop body", True)
                return i + 1

            def step(handed_in):
                read_gradients("a loss never scaled, in a function", False)
                read_gradients("a loss times the scale, in a function", True)
                read["gradients handed in as an argument"] = computed_without_the_scale(
                    [handed_in], scale
                )
                tf.while_loop(lambda i: i < 1, loop_body, [0])
                tf.cond(handed_in > 0, cond_branch, lambda: tf.constant(0))
                read_gradients(
                    "a loss times the scale in a nested function", True, nested=True
                )

            step = tf.function(step, autograph=False)
            step.get_concrete_function(tf.TensorSpec([]))
    except Exception as error:  # any change in what kmp reads
        return (f"the trace raised {error!r}",)
    return tuple(
        f"{case}: read {read.get(case)}, expected {answer}"
        for case, answer in _KNOWN_ANSWERS.items()
        if read.get(case) is not answer
    )
