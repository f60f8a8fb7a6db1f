"""Loss-scale telemetry in `fit` logs: the scale and skipped steps, per epoch,
in `History` and the progress bar, with no device sync inside the step.

The optimizer keeps the telemetry as variables; `LossScaleTelemetry` is a
Keras metric whose `result()` only reads them. Keras calls `result()` inside
the compiled train step, so the values travel with the loss, and resets the
metric at each epoch start, which is when the epoch's skip count starts. In
evaluation steps it reports nothing, so `model.evaluate` returns what it
would without kmp.

What it reads, per optimizer:

* a `kmp.LossScaleOptimizer`: `loss_scale` (when it scales: not in mode
  `'none'`), `skipped_steps` (this epoch) and `skipped_steps_total` (also in
  mode `'none'`: kmp skips non-finite steps under every policy);
* Keras's own `keras.optimizers.LossScaleOptimizer`: `loss_scale` (Keras
  counts no skipped steps).

Where a step skipped by a single `kmp.LossScaleOptimizer` had an inf/NaN
loss, which makes Keras's mean over every step NaN for the rest of the
epoch, `loss` is the mean loss of the steps it applied (`kmp.applied_loss`);
`skipped_steps` beside it counts what was left out. Everywhere else, and on
several replicas, `loss` is Keras's own.

A model compiled with several optimizers (`kmp.compile(gan,
d_optimizer=..., g_optimizer=...)`) logs each under its argument's name:
`d_optimizer_loss_scale`, ...
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import keras
import tensorflow as tf

from kmp import optimizer as optimizer_lib
from kmp import train_function
from kmp import traversal

logger = logging.getLogger("kmp")

LOG_KEYS = ("loss_scale", "skipped_steps", "skipped_steps_total")


def loss_scale_of(optimizer: Any):
    """The loss-scale variable of an optimizer that scales the loss (kmp's
    `loss_scale`, or Keras's own wrapper's `dynamic_scale`), or None."""
    if isinstance(optimizer, optimizer_lib.LossScaleOptimizer):
        return optimizer.dynamic_scale if optimizer.mode != "none" else None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return getattr(optimizer, "dynamic_scale", None)  # created at build
    return None


def optimizers_of(model: keras.Model) -> dict[str, Any]:
    """The optimizers telemetry reports for `model`, by label: the ones
    `kmp.compile` wrapped (by argument name), else `model.optimizer`."""
    registered = _registered.get(model)
    if registered:
        return dict(registered)
    opt = getattr(model, "optimizer", None)
    return {"optimizer": opt} if opt is not None else {}


# Optimizers kmp.compile wrapped, per model: {argument name: optimizer}.
_registered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register(model: keras.Model, optimizers: dict[str, Any]) -> None:
    """Records the optimizers `kmp.compile` wrapped for `model`."""
    _registered[model] = dict(optimizers)


class LossScaleTelemetry(keras.metrics.Metric):
    """Reports the loss scale and skipped steps of a model's loss-scaling
    optimizers (see the module docstring).

    Attach it with `kmp.telemetry.attach(model)`; `kmp.compile` does that for
    you. Under an optimizer that scales nothing and skips nothing it reports
    nothing.
    """

    def __init__(self, model: keras.Model, name: str = "kmp_loss_scale"):
        super().__init__(name=name)
        self._model_ref = weakref.ref(model)
        self._epoch_start = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="epoch_start"
        )
        self._epoch_starts: dict[str, Any] = {}
        for label in optimizers_of(model):
            self._start_variable(label)  # created now, not inside a trace

    def _optimizers(self) -> dict[str, Any]:
        model = self._model_ref()
        return optimizers_of(model) if model is not None else {}

    def update_state(self, *args, **kwargs):
        """Nothing to accumulate: the optimizers hold the state."""

    def _start_variable(self, label: str):
        if label == "optimizer":
            return self._epoch_start
        variable = self._epoch_starts.get(label)
        if variable is None:
            variable = self._epoch_starts[label] = self.add_variable(
                shape=(), dtype="int64", initializer="zeros", name=f"{label}_start"
            )
        return variable

    def reset_state(self):
        for label, opt in self._optimizers().items():
            if isinstance(opt, optimizer_lib.LossScaleOptimizer):
                self._start_variable(label).assign(opt.skipped_steps_total)
                opt.applied_loss.reset()

    def _loss_of_applied_steps(self, opt, skipped):
        """Keras's `loss`, or where a skipped step made it inf/NaN the mean
        loss of the applied steps (kmp.applied_loss); None where kmp leaves
        `loss` alone (several optimizers, several replicas, no loss tracker)."""
        model = self._model_ref()
        if model is None or tf.distribute.get_strategy().num_replicas_in_sync > 1:
            return None
        trackers = [
            m
            for m in model.metrics
            if m is not self and m.name == "loss" and isinstance(m, keras.metrics.Mean)
        ]
        if len(trackers) != 1:
            return None
        applied = opt.applied_loss
        if not applied.built:
            return None
        keras_loss = tf.cast(trackers[0].result(), tf.float32)
        replace = tf.logical_and(
            tf.logical_and(skipped > 0, applied.steps > 0),
            tf.logical_not(tf.math.is_finite(keras_loss)),
        )
        return tf.where(replace, applied.mean(), keras_loss)

    def result(self):
        optimizers = self._optimizers()
        logs = {}
        trained = False
        for label, opt in optimizers.items():
            prefix = "" if len(optimizers) == 1 else f"{label}_"
            if isinstance(opt, optimizer_lib.LossScaleOptimizer):
                # Only in training steps: evaluate() keeps returning what it did.
                if not opt.took_step():
                    continue
                trained = True
                values = _values(opt, prefix, self._start_variable(label))
                logs.update(values)
                if len(optimizers) == 1:
                    loss = self._loss_of_applied_steps(opt, values["skipped_steps"])
                    if loss is not None:
                        logs["loss"] = loss  # replaces Keras's (same name)
            elif isinstance(opt, keras.optimizers.LossScaleOptimizer):
                scale = loss_scale_of(opt)
                if scale is not None and _assigned_here(scale):
                    trained = True
                    logs[f"{prefix}loss_scale"] = tf.convert_to_tensor(scale)
        return logs if trained else {}


def _values(opt, prefix: str, epoch_start) -> dict[str, Any]:
    """The telemetry of one optimizer (tensors), read from its variables:
    `skipped_steps` only where `epoch_start` (the count at the epoch's
    start) is known."""
    logs: dict[str, Any] = {}
    scale = loss_scale_of(opt)
    if scale is not None:
        logs[f"{prefix}loss_scale"] = tf.convert_to_tensor(scale)
    if isinstance(opt, optimizer_lib.LossScaleOptimizer):
        total = tf.convert_to_tensor(opt.skipped_steps_total)
        if epoch_start is not None:
            logs[f"{prefix}skipped_steps"] = total - tf.convert_to_tensor(epoch_start)
        logs[f"{prefix}skipped_steps_total"] = total
    return logs


def step_logs(model: keras.Model, per_epoch: bool) -> dict[str, Any]:
    """kmp's telemetry for `model`, read after a training step from its
    optimizers' variables (for logs that do not carry it: a `train_step`
    returning its own dict). `skipped_steps` (this epoch) only with
    `per_epoch`, where the model's telemetry metric is among
    `model.metrics`, which Keras resets at each epoch start."""
    metric = getattr(model, "kmp_loss_scale_telemetry", None)
    optimizers = optimizers_of(model)
    logs: dict[str, Any] = {}
    for label, opt in optimizers.items():
        prefix = "" if len(optimizers) == 1 else f"{label}_"
        start = (
            metric._start_variable(label)
            if per_epoch and isinstance(metric, LossScaleTelemetry)
            else None
        )
        logs.update(_values(opt, prefix, start))
    return logs


def metric_in_metrics(model: keras.Model) -> bool:
    """Whether `model.metrics` holds its telemetry metric (a model that
    overrides `metrics` may leave it out)."""
    metric = getattr(model, "kmp_loss_scale_telemetry", None)
    return metric is not None and any(m is metric for m in model.metrics)


def _assigned_here(variable) -> bool:
    """Whether the graph being built assigns `variable` (Keras's own wrapper
    updates its scale in every train step, never in evaluation). Eagerly,
    with no graph to read, True."""
    if tf.executing_eagerly():
        return True
    graph = tf.compat.v1.get_default_graph()
    handle = getattr(getattr(variable, "value", None), "handle", None)
    if handle is None:
        handle = getattr(variable, "handle", None)
    for op in graph.get_operations():
        if op.type == "AssignVariableOp" and op.inputs and op.inputs[0] is handle:
            return True
    return _assigned_in_functions(graph, handle)


def _assigned_in_functions(graph, handle) -> bool:
    # Keras updates the scale inside tf.cond branches: their graphs capture
    # the variable's handle.
    for function in getattr(graph, "_functions", {}).values():
        inner = getattr(function, "graph", None)
        if inner is None:
            continue
        captured = {id(external) for external, _ in inner.captures}
        if id(handle) in captured:
            return True
    return False


def _track(model: keras.Model, metric: LossScaleTelemetry) -> None:
    """Adds `metric` to `model`'s metrics.

    Keras never locks the state of a Sequential or Functional model (their
    layers are their state), except that `Model.quantize` leaves the model's
    tracker locked when it returns; for those models the lock is lifted for
    this one attribute and put back. A subclassed model's lock (set when it
    is built) is respected: the caller warns.
    """
    tracker = getattr(model, "_tracker", None)
    lifted = (
        traversal.is_graph(model)
        and tracker is not None
        and getattr(tracker, "locked", False)
    )
    if lifted:
        tracker.unlock()
    try:
        model.kmp_loss_scale_telemetry = metric
    finally:
        if lifted:
            tracker.lock()


def attach(model: keras.Model, complete_plan: bool = False) -> keras.Model:
    """Makes `fit` log the loss scale and skipped steps of `model`'s
    loss-scaling optimizers (kmp's, or Keras's own wrapper's scale).
    Idempotent; `kmp.compile` calls it. Works before or after training and
    after `keras.models.load_model`: a train step already traced is traced
    again, with the telemetry, at the next `fit`. A `train_step` that
    returns its own dict, and a model whose state Keras has locked, get them
    from kmp's train function (`kmp.train_function`), which `attach` sets.

    Args:
        model: A compiled Keras model.
        complete_plan: For `kmp.compile`: the train function applies kmp's
            precision plan again once `fit` has built the model.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4),
    ...                           keras.layers.Dense(1)])
    >>> model = kmp.compile(model, optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    >>> sorted(k for k in history.history if "skip" in k or "scale" in k)
    ['loss_scale', 'skipped_steps', 'skipped_steps_total']
    """
    refused = _add_metric(model)
    if refused:
        logger.debug(
            "kmp.telemetry: %s's state is locked (%s): the train function adds "
            "the telemetry to its logs, without a per-epoch skip count.",
            type(model).__name__,
            refused,
        )
    train_function.install(model, complete_plan, step_logs, metric_in_metrics)
    return model


def _add_metric(model: keras.Model) -> str:
    """Adds a `LossScaleTelemetry` to `model`'s metrics (once), and has a
    train step traced before traced again with it. Returns `''`, or why
    Keras refused (it locks a built subclassed model's state)."""
    if isinstance(getattr(model, "kmp_loss_scale_telemetry", None), LossScaleTelemetry):
        return ""
    try:
        _track(model, LossScaleTelemetry(model))
    except ValueError as e:
        return str(e).strip() if str(e) != "None" else "no reason given"
    # A train step traced before has no telemetry in it: trace it again.
    if getattr(model, "train_function", None) is not None:
        model.train_function = None
    return ""
