"""What a model's activations reach on a batch: one float32 forward pass,
the largest finite |value| of every float tensor its ops produce, per layer.

Float16's largest value is 65504; bfloat16 and float32 reach about 3.4e38.
A layer whose activations reach float16's limit on real data overflows
there when it computes in float16, whatever the loss scale. The pass runs
every layer in float32 (their policies are restored after), so what it
reads is what the model computes, not what float16 makes of it.

Ops are attributed to the innermost layer whose call ran them (the name
scopes `kmp.backend.tracing` reads). Left out: data movement (casts,
reshapes, gathers: they compute nothing; an embedding's values are checked
where they are next computed on), weights (read, not computed), tensors
that flow into a softmax (attention scores and the masks added to them,
whose large negatives are chosen per dtype: -1e9 in float32, -3e4 in
float16), non-finite values (a float32 overflow, or a `-inf` mask, is not
float16's), and ops inside nested functions (a `tf.while_loop`'s body: the
loop's outputs are checked).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from kmp.backend import float32_pass
from kmp.backend import tracing
from kmp.precision import traversal


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """The largest activation one layer's own ops produced on a batch.

    Attributes:
        path: The layer's path in the model (the model's name for ops of
            the model's own code).
        class_name: The layer's class.
        max_abs: The largest finite |value| its ops produced (its
            sublayers' not included).
        op: The op that produced it, named inside the layer's scope
            (`'MatMul'`, `'ffn/Relu'` for an op in a sub-scope of its own).
    """

    path: str
    class_name: str
    max_abs: float
    op: str


@dataclasses.dataclass(frozen=True)
class Ranges:
    """The result of `activation_ranges`.

    Attributes:
        layers: One `LayerRange` per layer that computed something, in
            forward order.
        error: Why the pass could not run, or `''`.
        counted_all: Where only the 16-bit ops were asked for and the
            model could not be traced under its own policies to find them,
            why (then every op was counted); `''` otherwise.
    """

    layers: tuple[LayerRange, ...]
    error: str = ""
    counted_all: str = ""

    def above(self, limit: float) -> list[LayerRange]:
        """The layers whose activations reached `limit`."""
        return [r for r in self.layers if r.max_abs >= limit]


def _float(tensor) -> bool:
    return tensor.dtype.is_floating


def activation_ranges(
    model: keras.layers.Layer, x: Any, float16_only: bool = False
) -> Ranges:
    """Runs `model(x, training=False)` once with every layer in float32 and
    returns, per layer, the largest |value| its ops produced. A model that
    is not built is built first by a call on `x`, as its first call would.

    Args:
        model: A Keras model (or layer) that can be called on `x`.
        x: A batch of inputs, as the model takes them.
        float16_only: Count only the ops that compute in float16 under the
            layers' own policies (read from a trace of the same pass under
            them; nothing runs). An op the model computes in float32 or
            bfloat16 cannot overflow float16. Where the model cannot be
            traced under them (a layer that fails in float16), every op is
            counted and `Ranges.counted_all` says why.

    Returns:
        `Ranges`; its `error` says why when the model could not run on `x`.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")])
    >>> model.get_layer("d").set_weights([np.full((2, 1), 1e3), np.zeros(1)])
    >>> r = kmp.backend.ranges.activation_ranges(model, np.full((1, 2), 50.0))
    >>> [(layer.path, layer.max_abs) for layer in r.layers]
    [('d', 100000.0)]
    """
    if keras.backend.backend() != "tensorflow":
        return Ranges((), tracing.NOT_ON_THIS_BACKEND.format(keras.backend.backend()))
    import tensorflow as tf

    names: list[str] = []

    def forward(inputs):
        names.clear()  # traced again where the first trace made variables
        model(inputs, training=False)
        graph = tf.compat.v1.get_default_graph()
        maxima = []
        for op in graph.get_operations():
            if op.type in tracing.DATA_OPS or tracing.reaches_softmax(op):
                continue
            if float16_only and op.name not in kept:
                continue
            for i, t in enumerate(op.outputs):
                if not _float(t):
                    continue
                magnitude = tf.abs(tf.cast(t, "float32"))
                finite = tf.where(tf.math.is_finite(magnitude), magnitude, 0.0)
                maxima.append(finite if t.shape.rank == 0 else tf.reduce_max(finite))
                names.append(op.name if i == 0 else f"{op.name}:{i}")
        return maxima

    def float16_names(inputs):
        model(inputs, training=False)
        graph = tf.compat.v1.get_default_graph()
        kept.clear()
        kept.update(
            op.name
            for op in graph.get_operations()
            if op.outputs and op.outputs[0].dtype == tf.float16
        )

    inputs = keras.tree.map_structure(tf.convert_to_tensor, x)
    if not model.built:
        # Built first, as its first call would build it (its layers under
        # their own policies), so that the float32 pass sees every layer.
        try:
            model(inputs, training=False)
        except Exception as e:  # user code that cannot run on x: say why
            return Ranges((), tracing.error_line(e))
    kept: set[str] = set()
    counted_all = ""
    if float16_only:
        try:
            tf.function(float16_names).get_concrete_function(inputs)
        except Exception as e:  # user code that fails in 16-bit: count all
            float16_only = False
            counted_all = tracing.error_line(e)
    with float32_pass.every_layer_in_float32(model):
        try:
            values = tf.function(forward)(inputs)
        except Exception as e:  # user code that cannot run on x: say why
            return Ranges((), tracing.error_line(e))
    chains = tracing.owners(model, names)
    paths = {id(site.layer): site.path for site in traversal.walk(model)}
    best: dict[str, LayerRange] = {}
    for name, value in zip(names, values, strict=True):
        chain = chains[name]
        layer = chain[-1] if chain else model
        path = paths.get(id(layer), model.name) if chain else model.name
        magnitude = float(value)
        if path not in best or magnitude > best[path].max_abs:
            scope = name
            if chain:  # the op's name inside its layer's scope
                scope = "/".join(name.split("/")[len(chain) + 1 :])
            best[path] = LayerRange(path, type(layer).__name__, magnitude, scope)
    return Ranges(tuple(best.values()), counted_all=counted_all)
