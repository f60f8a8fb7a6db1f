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

On JAX, the optimizer's variables are not in scope inside the step, and
the metric reports nothing: kmp's train function reads the same values from
the state the step returns (`step_logs`).

`loss` is always Keras's own value. Beside it, a model trained by a single
`kmp.LossScaleOptimizer` on one replica also logs `applied_loss`: the mean
loss of the steps it applied (`kmp.scaling.applied_loss`). Where skipped
steps had an inf/NaN loss, `loss` is NaN and `applied_loss` is what trained.

A model compiled with several optimizers (`kmp.compile(gan,
d_optimizer=..., g_optimizer=...)`) logs each under its argument's name:
`d_optimizer_loss_scale`, ...
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import keras

from kmp.backend import distribute
from kmp.backend import graph
from kmp.backend.jax import state as jax_state
from kmp.scaling import applied_loss
from kmp.scaling import optimizer as optimizer_lib
from kmp.scaling import registry

logger = logging.getLogger("kmp")


def loss_scale_of(optimizer: Any):
    """The loss-scale variable (`dynamic_scale`) of an optimizer that scales
    the loss, kmp's or Keras's own wrapper, or None."""
    if isinstance(optimizer, optimizer_lib.LossScaleOptimizer):
        return optimizer.dynamic_scale if optimizer.mode != "none" else None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return getattr(optimizer, "dynamic_scale", None)  # created at build
    return None


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
        # Each start variable holds the same count on every replica: Keras's
        # default for a metric's variables (a sum over replicas) would count
        # it once per replica.
        self._epoch_start = self.add_variable(
            shape=(),
            dtype="int64",
            initializer="zeros",
            aggregation="only_first_replica",
            name="epoch_start",
        )
        self._epoch_starts: dict[str, Any] = {}
        for label in registry.optimizers_of(model):
            self.start_variable(label)  # created now, not inside a trace

    def _optimizers(self) -> dict[str, Any]:
        model = self._model_ref()
        return registry.optimizers_of(model) if model is not None else {}

    def update_state(self, *args, **kwargs):
        """Nothing to accumulate: the optimizers hold the state."""

    def start_variable(self, label: str):
        """The variable holding `label`'s skip count at the epoch's start."""
        if label == "optimizer":
            return self._epoch_start
        variable = self._epoch_starts.get(label)
        if variable is None:
            variable = self._epoch_starts[label] = self.add_variable(
                shape=(),
                dtype="int64",
                initializer="zeros",
                aggregation="only_first_replica",
                name=f"{label}_start",
            )
        return variable

    def reset_state(self):
        for label, opt in self._optimizers().items():
            if isinstance(opt, optimizer_lib.LossScaleOptimizer):
                # A copy: on JAX, two variables must not share one array,
                # which the step donates.
                total = keras.ops.copy(opt.skipped_steps_total.value)
                self.start_variable(label).assign(total)
                opt._applied_loss.reset()

    def result(self):
        if keras.backend.backend() == "jax":
            # Inside the JAX step the optimizer's values are not in scope:
            # kmp's train function reads them from the state it returns.
            return {}
        optimizers = self._optimizers()
        logs = {}
        trained = False
        for label, opt in optimizers.items():
            prefix = "" if len(optimizers) == 1 else f"{label}_"
            if isinstance(opt, optimizer_lib.LossScaleOptimizer):
                # Only in training steps: evaluate() keeps returning what it did.
                if not opt._ledger.took_step():
                    continue
                trained = True
                values = _values(opt, prefix, self.start_variable(label))
                logs.update(values)
                if len(optimizers) == 1:
                    mean = applied_loss.logged(self._model_ref(), self, opt)
                    if mean is not None:
                        logs["applied_loss"] = mean
            elif isinstance(opt, keras.optimizers.LossScaleOptimizer):
                scale = loss_scale_of(opt)
                if scale is not None and graph.assigned_here(scale):
                    trained = True
                    logs[f"{prefix}loss_scale"] = distribute.value(scale)
        return logs if trained else {}


def _read(variables: list) -> list:
    """The values of variables, read in the step being traced (TensorFlow)."""
    return [distribute.value(v) for v in variables]


def _values(opt, prefix: str, epoch_start, read=_read) -> dict[str, Any]:
    """The telemetry of one optimizer (tensors), read from its variables by
    `read` (a list of variables to their values): `skipped_steps` only where
    `epoch_start` (the count at the epoch's start) is known. Empty where
    `read` finds no value (None)."""
    kmp_optimizer = isinstance(opt, optimizer_lib.LossScaleOptimizer)
    variables = {
        "loss_scale": loss_scale_of(opt),
        "skipped_steps_total": opt.skipped_steps_total if kmp_optimizer else None,
        "epoch_start": epoch_start if kmp_optimizer else None,
    }
    variables = {k: v for k, v in variables.items() if v is not None}
    values = dict(zip(variables, read(list(variables.values())), strict=True))
    if any(value is None for value in values.values()):
        return {}
    logs: dict[str, Any] = {}
    if "loss_scale" in values:
        logs[f"{prefix}loss_scale"] = values["loss_scale"]
    if kmp_optimizer:
        total = values["skipped_steps_total"]
        if "epoch_start" in values:
            logs[f"{prefix}skipped_steps"] = total - values["epoch_start"]
        logs[f"{prefix}skipped_steps_total"] = total
    return logs


def step_logs(model: keras.Model, per_epoch: bool, state: Any = None) -> dict[str, Any]:
    """kmp's telemetry for `model`, read after a training step from its
    optimizers' variables (for logs that do not carry it: a `train_step`
    returning its own dict), or on JAX from the `state` the step returned.
    `skipped_steps` (this epoch) only with `per_epoch`, where the model's
    telemetry metric is among `model.metrics`, which Keras resets at each
    epoch start."""
    metric = getattr(model, "kmp_loss_scale_telemetry", None)
    optimizers = registry.optimizers_of(model)
    read = _read if state is None else jax_state.reader(model, state)
    logs: dict[str, Any] = {}
    for label, opt in optimizers.items():
        prefix = "" if len(optimizers) == 1 else f"{label}_"
        start = (
            metric.start_variable(label)
            if per_epoch and isinstance(metric, LossScaleTelemetry)
            else None
        )
        logs.update(_values(opt, prefix, start, read))
    return logs


def metric_in_metrics(model: keras.Model) -> bool:
    """Whether `model.metrics` holds its telemetry metric (a model that
    overrides `metrics` may leave it out)."""
    metric = getattr(model, "kmp_loss_scale_telemetry", None)
    return metric is not None and any(m is metric for m in model.metrics)
