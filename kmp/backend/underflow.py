"""How many of a model's gradient values a 16-bit backward pass loses at a
loss scale: one float32 forward and backward pass on a batch, per layer.

Loss scaling multiplies the gradients by the scale so that small ones stay
within float16's range; a value whose scaled magnitude is at most half
float16's smallest subnormal (2^-25, about 3e-8) rounds to zero there, and
one below its smallest normal (2^-14, about 6.1e-5) keeps fewer bits. What
a float16 backward pass computes has already lost those values, so the
measure runs the pass in float32 (every layer, their policies restored
after: `kmp.backend.float32_pass`) and counts, per layer that
computes in 16-bit, how many of its weights' nonzero gradient values,
times the scale, would flush to zero or be subnormal in its dtype, and the
largest one: how far the scale could grow before that layer's gradients
overflow.

The pass is Keras's stateless one (`stateless_call`,
`stateless_compute_loss`): the model's weights, its normalization
statistics, seeds and metrics are left as they are.
"""

from __future__ import annotations

import dataclasses
import textwrap
import warnings
import weakref
from typing import Any

import keras
import ml_dtypes
import numpy as np

from kmp._base.table import format_table
from kmp.backend import float32_pass
from kmp.backend import tracing
from kmp.precision import traversal

NOT_ON_THIS_BACKEND = (
    "kmp reads the gradients with TensorFlow's GradientTape, and Keras runs "
    "its {} backend here"
)
_SIXTEEN = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# The fraction of a layer's gradient values lost that `Underflow.advice`
# speaks of.
NOTABLE = 0.01
# model -> (what the measure was traced for, the traced measure).
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_with(model) -> tuple:
    """What the measure's trace reads of the model's compile: its loss and
    the loss weights (a compile with other ones is traced again)."""
    try:
        with warnings.catch_warnings():
            # Keras warns of a lambda loss it serializes; nothing is saved.
            warnings.simplefilter("ignore")
            weights = (model.get_compile_config() or {}).get("loss_weights")
    except Exception:  # a compile config Keras cannot serialize
        weights = None
    return _identity(getattr(model, "loss", None)), repr(weights)


def _identity(loss: Any) -> Any:
    """What tells the loss a model was compiled with from another, holding
    none of it (a loss function may hold the model): weak references to
    functions and Loss objects, strings as they are, containers by their
    parts."""
    if isinstance(loss, (str, type(None), int, float)):
        return loss
    if isinstance(loss, (list, tuple)):
        return tuple(_identity(part) for part in loss)
    if isinstance(loss, dict):
        return tuple((k, _identity(v)) for k, v in loss.items())
    try:
        return weakref.ref(loss)
    except TypeError:
        return id(loss)


@dataclasses.dataclass(frozen=True)
class LayerUnderflow:
    """What one layer's gradients lose in its 16-bit dtype at a scale.

    Attributes:
        path: The layer's path in the model.
        class_name: The layer's class.
        dtype: The dtype it computes in (`'float16'` or `'bfloat16'`).
        values: How many of its own weights' gradient values are nonzero.
        flushed: How many of those, times the scale, round to zero in
            `dtype`.
        subnormal: How many more are below `dtype`'s smallest normal (kept
            with fewer bits). 0 for bfloat16 on a CPU: its smallest normal
            is float32's (about 1.2e-38), and TensorFlow's CPU kernels flush
            float32's subnormals to zero, so the float32 pass has none.
        max_scaled: The largest |gradient| times the scale.
        headroom: How many times larger the scale can grow before its
            largest gradient overflows `dtype` (`inf` for all-zero ones).
    """

    path: str
    class_name: str
    dtype: str
    values: int
    flushed: int
    subnormal: int
    max_scaled: float
    headroom: float

    @property
    def flushed_fraction(self) -> float:
        """The fraction of its nonzero gradient values that flush to zero."""
        return self.flushed / self.values if self.values else 0.0

    @property
    def subnormal_fraction(self) -> float:
        """The fraction that is kept, subnormal."""
        return self.subnormal / self.values if self.values else 0.0


@dataclasses.dataclass(frozen=True)
class Underflow:
    """The result of `gradient_underflow`.

    Attributes:
        scale: The loss scale measured at.
        layers: One `LayerUnderflow` per layer computing in 16-bit that has
            trainable weights of its own, in the model's layer order.
        error: Why the pass could not run, or `''`.
    """

    scale: float
    layers: tuple[LayerUnderflow, ...]
    error: str = ""

    @property
    def flushed_fraction(self) -> float:
        """The fraction of all those layers' nonzero gradient values that
        flush to zero."""
        values = sum(r.values for r in self.layers)
        return sum(r.flushed for r in self.layers) / values if values else 0.0

    def worst(self) -> LayerUnderflow | None:
        """The layer that loses the largest fraction, or None."""
        lossy = [r for r in self.layers if r.flushed]
        return max(lossy, key=lambda r: r.flushed_fraction) if lossy else None

    def advice(self, threshold: float = NOTABLE) -> str:
        """What helps the layer that loses the most, where it loses at least
        `threshold` of its gradient values; `''` otherwise.

        A larger scale helps where it fits: the layer's largest gradient
        has room to grow (`headroom`), and dynamic scaling grows the scale
        unless another layer's gradients overflow first (the one with the
        least headroom). Where there is no room, its gradients span more
        than its dtype's range: computing it in float32 keeps them.
        """
        worst = self.worst()
        if worst is None or worst.flushed_fraction < threshold:
            return ""
        lost = (
            f"{worst.path!r} loses {worst.flushed_fraction:.1%} of its gradient "
            f"values to zero in {worst.dtype} at loss scale {self.scale:g}"
        )
        if worst.headroom >= 2:
            tightest = min(self.layers, key=lambda r: r.headroom)
            if tightest is worst:
                held = "; a higher initial_scale gets there sooner."
            else:
                held = (
                    f" (the nearest to overflowing: {tightest.path!r}, whose "
                    f"largest gradient overflows at {tightest.headroom:.3g}x; "
                    "in float32 it would not hold the scale down)."
                )
            return (
                f"{lost}; a scale up to {worst.headroom:.3g}x larger keeps its "
                "largest gradient in range. Dynamic scaling grows toward it "
                f"unless another layer's gradients overflow first{held}"
            )
        return (
            f"{lost}, and a larger scale would overflow its largest gradient: "
            f"its gradients span more than {worst.dtype}'s range. Computing it "
            f"in float32 keeps them: kmp.set_layer_policy('name:{worst.path}', "
            "'float32') before kmp.compile."
        )

    def __str__(self) -> str:
        if self.error:
            return f"Gradient underflow not measured: {self.error}"
        if not self.layers:
            return "Gradient underflow: no layer computes in 16-bit with weights."
        table = format_table(
            ("layer", "class", "computes", "flushed", "subnormal", "headroom"),
            [
                (
                    r.path,
                    r.class_name,
                    r.dtype,
                    f"{r.flushed_fraction:.1%}",
                    f"{r.subnormal_fraction:.1%}",
                    f"{r.headroom:.3g}x",
                )
                for r in self.layers
            ],
        )
        lines = [
            f"Gradient underflow at loss scale {self.scale:g}",
            table,
            textwrap.fill(
                "(of each layer's nonzero gradient values: flushed to zero, and "
                "kept subnormal, in its dtype; headroom: how much larger the "
                "scale can grow before its largest gradient overflows)",
                width=88,
            ),
        ]
        advice = self.advice()
        if advice:
            lines.append(textwrap.fill(advice, width=88, break_on_hyphens=False))
        return "\n".join(lines)


def _own_trainable(model: keras.layers.Layer) -> list[tuple[str, Any, list[int]]]:
    """(path, layer, positions in `model.trainable_variables`) per layer,
    each variable given to the deepest layer that holds it."""
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    owner: dict[int, tuple[int, str, Any]] = {}
    sites = [(model.name, model, 0)] + [
        (site.path, site.layer, site.path.count("/") + 1)
        for site in traversal.walk(model)
    ]
    for path, layer, depth in sites:
        for v in layer.trainable_variables:
            if id(v) in position and (id(v) not in owner or owner[id(v)][0] < depth):
                owner[id(v)] = (depth, path, layer)
    by_layer: dict[str, tuple[Any, list[int]]] = {}
    for key, (_, path, layer) in owner.items():
        by_layer.setdefault(path, (layer, []))[1].append(position[key])
    order = {path: i for i, (path, _, _) in enumerate(sites)}
    return [
        (path, layer, sorted(indices))
        for path, (layer, indices) in sorted(
            by_layer.items(), key=lambda item: order[item[0]]
        )
    ]


def gradient_underflow(
    model: keras.Model, x: Any, y: Any, scale: float, sample_weight: Any = None
) -> Underflow:
    """Runs one float32 training forward and backward pass of `model` on a
    batch and counts, per layer that computes in float16 or bfloat16, the
    gradient values that its dtype would lose at loss scale `scale` (see
    the module docstring). Nothing of the model changes.

    Args:
        model: A compiled Keras model (its loss is the one computed).
        x: A batch of inputs, as the model takes them.
        y: Their targets.
        scale: The loss scale (1 without scaling).
        sample_weight: Optional sample weights, as `fit` takes them.

    Returns:
        `Underflow`; its `error` says why when the pass could not run.

    Raises:
        ValueError: if the model is not compiled, or `scale` is not a
            positive finite number.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d")])
    >>> model.compile(loss="mse")
    >>> x, y = np.full((8, 4), 1e-3), np.zeros((8, 1))
    >>> model.get_layer("d").set_weights([np.full((4, 1), 1e-3), np.zeros(1)])
    >>> row = kmp.backend.underflow.gradient_underflow(model, x, y, 1.0).layers[0]
    >>> # The kernel's gradients (8e-9) flush to zero, the bias's (8e-6) is
    >>> # subnormal; at a scale of 1024 neither is lost.
    >>> row.path, row.values, row.flushed, row.subnormal
    ('d', 5, 4, 1)
    >>> kmp.backend.underflow.gradient_underflow(model, x, y, 1024.0).layers[0].flushed
    0
    """
    if not (isinstance(model, keras.Model) and model.compiled):
        raise ValueError(
            "gradient_underflow() computes the model's own loss: it needs a "
            "compiled Keras model. Received: "
            f"{type(model).__name__} {getattr(model, 'name', '')!r}, not compiled. "
            "Compile it first (kmp.compile(model, optimizer=..., loss=...))."
        )
    if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise ValueError(
            f"scale must be a positive finite number (the loss scale). Received: "
            f"{scale!r}."
        )
    if keras.backend.backend() != "tensorflow":
        return Underflow(
            float(scale), (), NOT_ON_THIS_BACKEND.format(keras.backend.backend())
        )
    import tensorflow as tf

    x, y, sample_weight = keras.tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight)
    )
    if not model.built:
        try:
            model(x, training=False)
        except Exception as e:  # user code that cannot run on x: say why
            return Underflow(float(scale), (), tracing.error_line(e))
    owned = [
        (path, layer, indices, str(layer.compute_dtype))
        for path, layer, indices in _own_trainable(model)
        if str(layer.compute_dtype) in _SIXTEEN
    ]
    if not owned:
        return Underflow(float(scale), ())
    limits = {
        name: (
            float(ml_dtypes.finfo(kind).smallest_subnormal) / 2,
            float(ml_dtypes.finfo(kind).smallest_normal),
        )
        for name, kind in _SIXTEEN.items()
    }
    wanted = sorted({i for _, _, indices, _ in owned for i in indices})
    bounds = {}
    for _, _, indices, dtype in owned:
        for i in indices:
            bounds[i] = limits[dtype]

    held = weakref.ref(model)  # the cache holds the function, not the model

    def counts(x, y, sample_weight, scale):
        model = held()
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in model.metrics_variables]
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            y_pred, non_trainable = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss, _ = model.stateless_compute_loss(
                trainable,
                non_trainable,
                metrics,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
        grads = tape.gradient(tf.cast(loss, "float32"), [trainable[i] for i in wanted])
        counted, maxima = [], []
        for i, g in zip(wanted, grads, strict=True):
            if g is None:
                counted.append(tf.zeros((3,), tf.int64))
                maxima.append(tf.constant(0.0))
                continue
            if isinstance(g, tf.IndexedSlices):
                g = g.values  # the rows computed, not a dense copy
            a = tf.abs(tf.cast(g, "float32")) * scale
            flush, normal = bounds[i]
            nonzero = a > 0
            counted.append(
                tf.stack(
                    [
                        tf.math.count_nonzero(nonzero),
                        tf.math.count_nonzero(nonzero & (a <= flush)),
                        tf.math.count_nonzero((a > flush) & (a < normal)),
                    ]
                )
            )
            maxima.append(tf.reduce_max(tf.where(tf.math.is_finite(a), a, 0.0)))
        return tf.stack(counted), tf.stack(maxima)

    key = (
        *_compiled_with(model),
        len(model.trainable_variables),
        len(model.non_trainable_variables),
        len(model.metrics_variables),
        tuple((path, dtype, tuple(indices)) for path, _, indices, dtype in owned),
    )
    cached = _FUNCTIONS.get(model)
    if cached is None or cached[0] != key:
        # Kept per model (traced again only for new shapes, or where a
        # layer's precision changed): a monitor measures every epoch.
        cached = (key, tf.function(counts, reduce_retracing=True))
        _FUNCTIONS[model] = cached
    with float32_pass.every_layer_in_float32(model):
        try:
            counted, maxima = cached[1](
                x, y, sample_weight, tf.constant(scale, "float32")
            )
        except Exception as e:  # user code that cannot run on x: say why
            return Underflow(float(scale), (), tracing.error_line(e))
    counted, maxima = counted.numpy(), maxima.numpy()
    row_of = {i: r for r, i in enumerate(wanted)}
    rows = []
    for path, layer, indices, dtype in owned:
        at = [row_of[i] for i in indices]
        total = counted[at].sum(axis=0)
        top = float(maxima[at].max())
        largest = float(ml_dtypes.finfo(_SIXTEEN[dtype]).max)
        rows.append(
            LayerUnderflow(
                path,
                type(layer).__name__,
                dtype,
                int(total[0]),
                int(total[1]),
                int(total[2]),
                top,
                largest / top if top > 0 else float("inf"),
            )
        )
    return Underflow(float(scale), tuple(rows))
