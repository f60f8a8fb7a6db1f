"""What 16-bit does to each layer's result on a batch: the model run once
at its own policies and once with every layer in float32, each layer's
results compared.

A layer's error is how far its results move from float32's, relative to
their size (`|y16 - y32| / |y32|`, over the batch). Its input error is the
same for what enters it. A 16-bit result is expected to move by a few
units of its dtype's rounding, plus what its inputs bring. A layer that
moves by far more does what 16-bit cannot carry: it cancels (`E[x²] -
E[x]²`), or its inputs carry more digits than 16 bits hold and are
rounded at its boundary (a temperature of 300.4 K becomes 300 in
bfloat16).

Ops are attributed to the innermost layer whose call ran them (the name
scopes `kmp.backend.tracing` reads). A layer's results are the tensors its
own ops (data movement included) hand to other code; its inputs are the
tensors its own ops take from other code. Each is compared with the
tensor of the same name in the float32 pass, followed back through casts
(a pass computes in float32 where the other casts). Left out: weights and
constants, tensors that flow into a softmax (masks are chosen per dtype),
non-finite values (an overflow is a range problem, not a precision one),
layers that draw random numbers (each pass draws its own), and ops inside
nested functions. The passes leave the model's state (random seeds, a
stateful RNN's states) as they found it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from kmp.backend import float32_pass
from kmp.backend import tracing
from kmp.precision import policy as policy_lib
from kmp.precision import traversal

# The spacing of 16-bit numbers relative to their size (half of it is the
# largest rounding error of one value).
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}

# A result that moves by more than this many units of its dtype's spacing,
# and by more than this many times its inputs' error, is named.
ROUNDING_UNITS = 16
AMPLIFICATION = 8

# Packages whose layers the user does not edit.
_KERAS_PACKAGES = frozenset(("keras", "keras_hub", "keras_nlp", "keras_cv", "tf_keras"))


@dataclasses.dataclass(frozen=True)
class LayerDrift:
    """How far one layer's results moved from float32 on a batch.

    Attributes:
        path: The layer's path in the model.
        class_name: The layer's class.
        compute_dtype: The dtype the layer computes in.
        error: The largest relative error of its results.
        input_error: The largest relative error of its inputs, as it takes
            them (rounded to 16-bit at its boundary, where they are).
        rounded_at_boundary: Whether a float32 input lost digits when it was
            cast to 16-bit on its way into the layer (Keras casts a layer's
            inputs to its compute dtype before its `call` runs).
        rounded_by: The paths of the 16-bit layers whose results it takes.
        keras_class: Whether its class is Keras's or a Keras library's
            (code the user does not edit).
    """

    path: str
    class_name: str
    compute_dtype: str
    error: float
    input_error: float
    rounded_at_boundary: bool
    rounded_by: tuple[str, ...]
    keras_class: bool

    @property
    def fix_paths(self) -> tuple[str, ...]:
        """The layers to compute in float32 to fix it: itself, and the
        16-bit layers whose results it takes."""
        return (self.path, *self.rounded_by)


@dataclasses.dataclass(frozen=True)
class Drifts:
    """The result of `layer_drift`.

    Attributes:
        layers: One `LayerDrift` per layer whose results could be compared,
            in forward order.
        dtype: The 16-bit dtype the model computes in, or `''` where it
            computes nothing in 16-bit (then `layers` is empty).
        error: Why the passes could not run, or `''`.
    """

    layers: tuple[LayerDrift, ...]
    dtype: str = ""
    error: str = ""

    def beyond_rounding(self) -> list[LayerDrift]:
        """The layers whose results moved by far more than 16-bit rounding
        and their inputs explain."""
        if not self.dtype:
            return []
        return [
            d
            for d in self.layers
            if d.error > ROUNDING_UNITS * EPSILON[self.dtype_of(d)]
            and d.error > AMPLIFICATION * d.input_error
        ]

    def dtype_of(self, d: LayerDrift) -> str:
        """The 16-bit dtype whose rounding `d` is judged by: its own, or the
        model's for a layer that computes in float32 on 16-bit inputs."""
        return d.compute_dtype if d.compute_dtype in EPSILON else self.dtype


_NOT_COMPUTED = frozenset(
    ("Const", "ReadVariableOp", "VarHandleOp", "Placeholder", "NoOp")
)


def _random(op) -> bool:
    """An op that draws random numbers (a sampling layer, noise, dropout):
    the two passes draw different ones."""
    return "Random" in op.type or op.type == "RngReadAndSkip"


def _boundaries(model, graph) -> dict[str, dict]:
    """Per layer path, from the ops of `graph`: the tensors its own ops
    hand to other code ('out') and those they take from it ('in'), each as
    (the name as it leaves or is taken, the name of what computed it,
    followed back through casts); of the inputs, the float32 ones cast to
    16-bit on the way in ('cast'); the paths of the layers that computed
    its 16-bit inputs ('by'); whether it draws random numbers ('random');
    and the layer."""
    import tensorflow as tf

    ops = [op for op in graph.get_operations() if op.type not in _NOT_COMPUTED]
    chains = tracing.owners(model, [op.name for op in graph.get_operations()])
    owner = {name: (chain[-1] if chain else None) for name, chain in chains.items()}
    paths = {id(site.layer): site.path for site in traversal.walk(model)}
    found: dict[str, dict] = {}
    for op in ops:
        layer = owner[op.name]
        if layer is None or id(layer) not in paths:
            continue
        entry = found.setdefault(
            paths[id(layer)],
            {
                "layer": layer,
                "out": [],
                "in": [],
                "cast": [],
                "by": set(),
                "random": False,
            },
        )
        entry["random"] = entry["random"] or _random(op)
        for t in op.inputs:
            if not t.dtype.is_floating:
                continue
            source = tracing.source(t, casts=True)
            if owner.get(source.op.name) is layer:
                continue
            if source.op.type in _NOT_COMPUTED - {"Placeholder"}:
                continue  # a weight or a constant: its rounding is the layer's own
            if tracing.reaches_softmax(source.op):
                continue  # a mask, chosen per dtype
            if source.dtype == tf.float32 and t.dtype in (tf.float16, tf.bfloat16):
                entry["cast"].append((t.name, source.name))
            entry["in"].append((t.name, source.name))
            producer = owner.get(source.op.name)
            if producer is not None and source.dtype != tf.float32:
                entry["by"].add(paths.get(id(producer), producer.name))
        for t in op.outputs:
            if not t.dtype.is_floating or tracing.reaches_softmax(op):
                continue
            consumers = t.consumers()
            if not consumers or any(owner.get(c.name) is not layer for c in consumers):
                entry["out"].append((t.name, tracing.source(t, casts=True).name))
    return found


def _run(model, inputs, wanted: list[str] | None):
    """Runs `model(inputs)` traced; returns the layers' boundaries as traced
    and the float32 values of the tensors named in `wanted` (of every
    boundary tensor where None)."""
    import tensorflow as tf

    found: dict[str, dict] = {}
    names: list[str] = []

    def forward(x):
        model(x, training=False)
        graph = tf.compat.v1.get_default_graph()
        found.clear()
        found.update(_boundaries(model, graph))
        names.clear()
        if wanted is None:
            for entry in found.values():
                pairs = entry["in"] + entry["out"]
                names.extend(n for pair in pairs for n in pair if n not in names)
        else:
            names.extend(wanted)
        values = []
        kept = []
        for name in names:
            try:
                t = graph.get_tensor_by_name(name)
            except (KeyError, ValueError):
                continue
            values.append(tf.cast(t, "float32"))
            kept.append(name)
        names[:] = kept
        return values

    values = tf.function(forward)(inputs)
    return found, dict(zip(names, (np.asarray(v) for v in values), strict=True))


def _relative_error(low, high) -> float | None:
    """|low - high| / |high| over the values finite in both; None where the
    16-bit values hold a non-finite one float32's do not (a range problem),
    or float32's are all zero."""
    if low.shape != high.shape:
        return None
    finite = np.isfinite(high)
    if not np.isfinite(low[finite]).all():
        return None
    scale = np.linalg.norm(high[finite])
    if scale == 0:
        return None
    return float(np.linalg.norm(low[finite] - high[finite]) / scale)


def layer_drift(model: keras.layers.Layer, x: Any) -> Drifts:
    """Runs `model(x, training=False)` at its layers' own policies and with
    every layer in float32, and returns how far each layer's results moved.
    A model that is not built is built first by a call on `x`.

    Args:
        model: A Keras model (or layer) that can be called on `x`.
        x: A batch of inputs, as the model takes them.

    Returns:
        `Drifts`; its `error` says why when the model could not run on `x`.

    Example:

    >>> class Spread(keras.layers.Layer):
    ...     def call(self, x):  # E[x²] - E[x]²: cancels
    ...         return keras.ops.mean(x * x, -1) - keras.ops.mean(x, -1) ** 2
    >>> model = keras.Sequential([keras.Input((4,)), Spread(name="spread")])
    >>> model.get_layer("spread").dtype_policy = "mixed_bfloat16"
    >>> x = np.array([[300.4, 301.1, 299.7, 300.2]])
    >>> [d.path for d in kmp.backend.drift.layer_drift(model, x).beyond_rounding()]
    ['spread']
    """
    layers = [model] + [site.layer for site in traversal.walk(model)]
    sixteen = [str(layer.compute_dtype) for layer in layers]
    dtype = next((d for d in policy_lib.SIXTEEN_BIT if d in sixteen), "")
    if not dtype:
        return Drifts((), "")
    backend = keras.backend.backend()
    if backend != "tensorflow":
        return Drifts((), dtype, tracing.NOT_ON_THIS_BACKEND.format(backend))
    import tensorflow as tf

    inputs = keras.tree.map_structure(tf.convert_to_tensor, x)
    try:
        if not model.built:
            model(inputs, training=False)
        # The passes leave the model's state as they found it: random seeds,
        # a stateful RNN's states.
        state = [(v, v.numpy()) for v in model.non_trainable_variables]
        try:
            found, low = _run(model, inputs, None)
            with float32_pass.every_layer_in_float32(model):
                _, high = _run(model, inputs, list(low))
        finally:
            for variable, value in state:
                variable.assign(value)
    except Exception as e:  # user code that cannot run on x: say why
        return Drifts((), dtype, tracing.error_line(e))

    def worst(pairs, against) -> float:
        errors = [_relative_error(low[a], against[b]) for a, b in pairs]
        return max((e for e in errors if e is not None), default=0.0)

    drifts = []
    for path, entry in found.items():
        out = [(a, b) for a, b in entry["out"] if b in high]
        if not out or entry["random"]:
            continue
        layer = entry["layer"]
        taken = [(a, b) for a, b in entry["in"] if b in high]
        drifts.append(
            LayerDrift(
                path,
                type(layer).__name__,
                str(layer.compute_dtype),
                worst(out, high),
                worst(taken, high),
                worst(entry["cast"], low) > 0,
                tuple(sorted(entry["by"])),
                type(layer).__module__.split(".")[0] in _KERAS_PACKAGES,
            )
        )
    return Drifts(tuple(drifts), dtype)
