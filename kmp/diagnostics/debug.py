"""Finding what went non-finite, and where: overflow attribution and a
layer-by-layer non-finite search. (`kmp.debug.precision_audit`, the
pre-training audit, lives in `kmp.diagnostics.audit`.)

Functions here return data objects; `str()` of each is a readable report.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np

from kmp._base import backends
from kmp.backend import graph
from kmp.diagnostics import compiled_by
from kmp.precision import policy as policy_lib
from kmp.precision import traversal
from kmp.scaling import optimizer as optimizer_lib
from kmp.scaling import telemetry

FLOAT16_MAX = policy_lib.FLOAT16_MAX


def _owners(model: keras.layers.Layer) -> dict[int, str]:
    """id(variable) -> path of the innermost layer that owns it."""
    owner: dict[int, str] = {}
    for site in traversal.walk(model):
        for weight in site.layer.weights:
            owner[id(weight)] = site.path
    return owner


# --- overflow attribution ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OverflowSources:
    """Which variables had non-finite gradients at the last skipped step, and
    the layers they belong to (empty when no step was skipped).

    Attributes:
        layers: Paths of the layers owning those variables.
        variables: Paths of the variables.
        forward: True when the last loss itself was inf/NaN: the forward
            pass overflowed, so every gradient is non-finite and the layers
            listed are not the culprit; `find_nonfinite` on a batch is.
    """

    layers: tuple[str, ...]
    variables: tuple[str, ...]
    forward: bool = False

    def __bool__(self) -> bool:
        return bool(self.variables)

    def __str__(self) -> str:
        if not self:
            return "No skipped step: no overflow to attribute."
        if self.forward:
            return (
                "The loss itself was inf/NaN (a forward overflow); run "
                "kmp.debug.find_nonfinite(model, x) on a failing batch to find "
                "the layer."
            )
        return "Non-finite gradients in: " + ", ".join(self.layers)


def _kmp_optimizer(model: keras.Model) -> optimizer_lib.LossScaleOptimizer:
    opt = optimizer_lib.of_model(model)
    if opt is None:
        raise ValueError(
            "Overflow attribution needs the model compiled with a "
            "kmp.LossScaleOptimizer (kmp.compile does that under every policy; "
            "Keras's model.compile does not). Received a model whose optimizer "
            f"is {type(getattr(model, 'optimizer', None)).__name__}: compile it "
            "with kmp.compile(model, ...), which takes model.compile's arguments."
        )
    return opt


def last_overflow(model: keras.Model) -> OverflowSources:
    """Maps the last skipped step's non-finite gradients to layers.

    The optimizer records, in the same pass as its finite check, which
    variables had inf/NaN gradients; this reads that record (no computation).

    Args:
        model: A model compiled with a `kmp.LossScaleOptimizer`.

    Returns:
        `OverflowSources` with the layer paths and variable paths involved.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="out")])
    >>> model = kmp.compile(model, optimizer="sgd", loss="mse")
    >>> _ = model.train_on_batch(np.array([[1e30, 1.0]]), np.ones((1, 1)))
    >>> kmp.debug.last_overflow(model).layers
    ('out',)
    """
    opt = _kmp_optimizer(model)
    if not opt.built:
        return OverflowSources((), ())
    return overflow_sources(
        model,
        keras.ops.convert_to_numpy(opt.overflow_record.flags),
        bool(keras.ops.convert_to_numpy(opt.overflow_record.loss_finite)),
    )


def overflow_sources(
    model: keras.Model, flags: Any, loss_finite: bool
) -> OverflowSources:
    """Maps per-variable finite flags (as the optimizer records them, in its
    build order) to layers. `last_overflow` reads the live record; the
    monitor passes snapshots taken during training."""
    opt = _kmp_optimizer(model)
    owner = _owners(model)
    layers: list[str] = []
    variables: list[str] = []
    for finite, variable in zip(flags, opt.overflow_record.variables, strict=True):
        if finite:
            continue
        variables.append(variable.path)
        layer = owner.get(id(variable), "?")
        if layer not in layers:
            layers.append(layer)
    forward = bool(variables) and not loss_finite
    return OverflowSources(tuple(layers), tuple(variables), forward)


# --- the non-finite search ------------------------------------------------------


def _max_abs(values: Any) -> float:
    arrays = [
        np.asarray(keras.ops.convert_to_numpy(v), dtype="float64")
        for v in keras.tree.flatten(values)
        if v is not None
        and keras.backend.is_float_dtype(keras.backend.standardize_dtype(v.dtype))
    ]
    if not arrays:
        return 0.0
    worst = 0.0
    for a in arrays:
        if a.size == 0:
            continue
        if np.isnan(a).any():
            return math.nan
        worst = max(worst, float(np.max(np.abs(a))))
    return worst


def _finite(value: float) -> bool:
    return math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class LayerCheck:
    """What one layer did on the batch."""

    path: str
    class_name: str
    compute_dtype: str
    input_max_abs: float
    output_max_abs: float
    gradient_max_abs: float | None = None


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """The result of `kmp.debug.find_nonfinite`.

    Attributes:
        found: Whether a layer produced inf/NaN.
        phase: `'forward'` (its output) or `'backward'` (its gradient).
        layer: Path of the first layer that did.
        class_name, compute_dtype, input_max_abs, output_max_abs: Of that layer.
        fix: What to try.
        note: Limits of the search (e.g. subclassed models).
        checks: Every layer checked, in forward order.
    """

    found: bool
    phase: str | None = None
    layer: str | None = None
    class_name: str | None = None
    compute_dtype: str | None = None
    input_max_abs: float | None = None
    output_max_abs: float | None = None
    fix: str = ""
    note: str = ""
    checks: tuple[LayerCheck, ...] = ()

    @classmethod
    def at(
        cls,
        check: LayerCheck,
        phase: str,
        fix: str,
        note: str = "",
        checks: tuple[LayerCheck, ...] = (),
    ) -> NonFiniteReport:
        """A report that names the layer of `check`."""
        return cls(
            True,
            phase,
            check.path,
            check.class_name,
            check.compute_dtype,
            check.input_max_abs,
            check.output_max_abs,
            fix,
            note=note,
            checks=checks,
        )

    def __str__(self) -> str:
        lines = []
        if not self.found:
            lines.append(f"No inf/NaN found in {len(self.checks)} layers.")
        else:
            what = "output" if self.phase == "forward" else "gradient"
            lines.append(
                f"First non-finite {what}: layer {self.layer!r} ({self.class_name}, "
                f"computes in {self.compute_dtype}); max |input| = "
                f"{self.input_max_abs:.4g}, max |output| = {self.output_max_abs:.4g}."
            )
            lines.append(f"Fix: {self.fix}")
        if self.note:
            lines.append(f"Note: {self.note}")
        return "\n".join(lines)


def _fix_for(layer: keras.layers.Layer, path: str, phase: str, scale: float | None):
    weights = _max_abs(layer.weights) if layer.weights else 0.0
    hint = (
        f" Its weights reach |w| = {weights:.3g}: if they exploded (bad "
        "initialization, learning rate or checkpoint), fix them first."
        if weights > 100
        else ""
    )
    return _precision_fix(layer, path, phase, scale) + hint


def _precision_fix(layer, path, phase, scale) -> str:
    cls = type(layer).__name__
    if layer.compute_dtype in policy_lib.SIXTEEN_BIT:
        limit = (
            f"float16 overflows above {FLOAT16_MAX:g}"
            if layer.compute_dtype == "float16"
            else "bfloat16 loses precision"
        )
        fix = (
            f"compute this layer in float32: kmp.set_layer_policy({cls}, "
            f"'float32') or kmp.set_layer_policy('name:{path}', 'float32'), "
            f"then kmp.prepare(model) ({limit})."
        )
        if phase == "backward" and scale is not None:
            fix += (
                f" Or start from a lower loss scale than {scale:g} "
                "(kmp.LossScaleOptimizer(..., initial_scale=...))."
            )
        return fix
    return (
        "this layer overflows even in float32: check its weights and inputs "
        "for exploding values (learning rate, initialization, input scaling)."
    )


def _probe(model: keras.Model):
    """A functional model returning every top-level layer's input and output."""
    layers = [
        layer
        for layer in traversal.children(model)
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    outputs: dict[str, Any] = {}
    usable = []
    for layer in layers:
        try:
            outputs[f"in:{layer.name}"] = layer.input
            outputs[f"out:{layer.name}"] = layer.output
        except (AttributeError, ValueError):  # shared layers have no single output
            continue
        usable.append(layer)
    outputs["__y_pred__"] = (
        model.outputs[0] if len(model.outputs) == 1 else (model.outputs)
    )
    inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    return usable, keras.Model(inputs, outputs)


def find_nonfinite(
    model: keras.Model, x: Any, y: Any = None, *, _prefix: str = ""
) -> NonFiniteReport:
    """Runs `model` on one batch, layer by layer, and reports the first layer
    whose output (or, with `y`, whose gradient) holds inf or NaN.

    The search runs under the model's current precision, so it reproduces
    what training sees. With `y` the model must be compiled: the loss is its
    compiled loss, multiplied by the `kmp.LossScaleOptimizer`'s current scale
    if it has one, and the first layer in backward order whose output
    gradient or weight gradient is non-finite is reported.

    Sequential and Functional models are searched layer by layer, nested
    models recursively. A subclassed model has no graph kmp can read: it is
    checked as a whole, and the report says so.

    Args:
        model: A Keras model.
        x: A batch of inputs.
        y: Optional targets, to search the backward pass too (on
            TensorFlow: the search reads gradients with its tape).

    Returns:
        A `NonFiniteReport`; `print()` it.

    Raises:
        NotImplementedError: for `y` on another Keras backend.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="a"),
    ...                           keras.layers.Dense(1, name="b")])
    >>> model.get_layer("b").set_weights([np.full((2, 1), 1e3), np.zeros(1)])
    >>> report = kmp.debug.find_nonfinite(model, np.full((1, 2), 1e3))
    >>> report.layer, report.phase, report.compute_dtype
    ('b', 'forward', 'float16')
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "find_nonfinite() expects a Keras model. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    if y is not None:
        backends.require_tensorflow(
            "find_nonfinite's backward search (its y argument)",
            "Call kmp.debug.find_nonfinite(model, x) to search the forward "
            "pass; kmp.debug.last_overflow(model) names the layers whose "
            "gradients overflowed in the last skipped step.",
        )
    compiled_by.note_compiled_without_kmp(model, "kmp.debug.find_nonfinite")
    if not _finite(_max_abs(x)):
        return NonFiniteReport.at(
            LayerCheck("<input>", "input batch", "", _max_abs(x), _max_abs(x)),
            "forward",
            "the input batch itself holds inf/NaN: clean or filter the data "
            "(e.g. tf.debugging.check_numerics in the input pipeline).",
        )
    if not isinstance(model, keras.Model) or not getattr(model, "inputs", None):
        return _whole_model(model, x, _prefix)
    layers, probe = _probe(model)
    scale = None
    if y is None:
        values = probe(x, training=False)
    else:
        if not model.compiled:
            raise ValueError(
                "find_nonfinite(model, x, y) searches the backward pass with the "
                "model's compiled loss, but the model is not compiled. Compile it "
                "first, or call find_nonfinite(model, x) for the forward pass only."
            )
        # The optimizer's scale, kmp's or Keras's wrapper's.
        optimizer = getattr(model, "optimizer", None)
        variable = telemetry.loss_scale_of(optimizer)
        if variable is not None:
            scale = float(keras.ops.convert_to_numpy(variable))
        with graph.persistent_tape() as tape:
            values = probe(x, training=True)
            loss = model.compute_loss(
                x=x, y=y, y_pred=values["__y_pred__"], training=True
            )
            if isinstance(optimizer, optimizer_lib.LossScaleOptimizer):
                loss = optimizer._scale.scale(loss)
            elif scale is not None:
                loss = loss * scale
    checks = []
    for layer in layers:
        checks.append(
            LayerCheck(
                f"{_prefix}{layer.name}",
                type(layer).__name__,
                layer.compute_dtype,
                _max_abs(values[f"in:{layer.name}"]),
                _max_abs(values[f"out:{layer.name}"]),
            )
        )
    for layer, check in zip(layers, checks, strict=True):
        if _finite(check.output_max_abs) or not _finite(check.input_max_abs):
            continue
        if isinstance(layer, keras.Model) and getattr(layer, "inputs", None):
            inner = find_nonfinite(
                layer, values[f"in:{layer.name}"], _prefix=f"{check.path}/"
            )
            if inner.found:
                return dataclasses.replace(inner, checks=tuple(checks))
        return NonFiniteReport.at(
            check,
            "forward",
            _fix_for(layer, check.path, "forward", scale),
            checks=tuple(checks),
        )
    if not _finite(_max_abs(values["__y_pred__"])):
        # The output is non-finite but no layer's (first) call was: a shared
        # layer overflowed in a later call, which the graph does not expose.
        whole = LayerCheck(
            _prefix + model.name,
            type(model).__name__,
            model.compute_dtype,
            _max_abs(x),
            _max_abs(values["__y_pred__"]),
        )
        return NonFiniteReport.at(
            whole,
            "forward",
            "see the note.",
            note=(
                "The model's output holds inf/NaN, but no layer's first call "
                "does: a layer called more than once (shared) overflows in a "
                "later call. kmp checks each layer's first call only."
            ),
            checks=tuple(checks),
        )
    if y is None:
        return NonFiniteReport(False, checks=tuple(checks))
    # Backward: from the output toward the input.
    for layer, check in reversed(list(zip(layers, checks, strict=True))):
        out_grad = tape.gradient(loss, values[f"out:{layer.name}"])
        weight_grads = tape.gradient(loss, layer.trainable_weights)
        grad_max = max(
            [_max_abs(out_grad)] + [_max_abs(g) for g in weight_grads if g is not None],
            key=lambda v: math.inf if math.isnan(v) else v,
        )
        if not _finite(grad_max):
            return NonFiniteReport.at(
                check,
                "backward",
                _fix_for(layer, check.path, "backward", scale),
                note=_backward_note(checks, scale),
                checks=tuple(checks),
            )
    del tape
    return NonFiniteReport(False, checks=tuple(checks))


def _backward_note(checks: list[LayerCheck], scale: float | None) -> str:
    notes = []
    if scale:
        notes.append(f"Loss multiplied by the loss scale {scale:g}.")

    def gain(c: LayerCheck) -> float:
        return c.output_max_abs / max(c.input_max_abs, 1e-30)

    largest = max(checks, key=gain)
    notes.append(
        f"Largest amplification: {largest.path!r} (max |input| "
        f"{largest.input_max_abs:.3g} -> max |output| {largest.output_max_abs:.3g}; "
        f"float16 max {FLOAT16_MAX:g}): exploding weights there make the "
        "gradients of the layers next to it overflow."
    )
    return " ".join(notes)


def _whole_model(model, x, prefix) -> NonFiniteReport:
    y = model(x, training=False)
    check = LayerCheck(
        prefix + model.name,
        type(model).__name__,
        model.compute_dtype,
        _max_abs(x),
        _max_abs(y),
    )
    note = (
        f"{type(model).__name__} is a subclassed model (or unbuilt): its layers "
        "are called from Python code kmp cannot trace, so only its output was "
        "checked. Call find_nonfinite on its sublayers, or build it with the "
        "Functional API, to narrow it down."
    )
    if _finite(check.output_max_abs):
        return NonFiniteReport(False, note=note, checks=(check,))
    return NonFiniteReport.at(
        check, "forward", "see the note.", note=note, checks=(check,)
    )
