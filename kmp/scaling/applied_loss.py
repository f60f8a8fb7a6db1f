"""The mean loss of the steps that were applied, logged as `applied_loss`.

Keras's `loss` in the progress bar and in `History` is the mean of every
step's loss in the epoch, and kmp leaves it so. A step kmp skips (its
gradients were inf/NaN) may have an inf/NaN loss, which makes that mean
inf/NaN for the rest of the epoch. `kmp.LossScaleOptimizer` keeps the sum
and count of the losses of the steps it applied (recorded in `scale_loss`,
settled in `apply`), and kmp's telemetry logs their mean beside `loss` as
`applied_loss`. With gradient accumulation, the losses counted are those of
the micro-batches whose gradients were finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from kmp.backend import distribute


class AppliedLoss:
    """The losses of applied steps since the last `reset`.

    Its variables are made by `build` (the optimizer's, at the end of its own
    build, so that the variables before them keep their positions in a
    `tf.train.Checkpoint`); until then `record` and `settle` do nothing. They
    are control values: kmp's `.keras` state leaves them out.
    """

    def __init__(self):
        self.built = False

    def build(self, make_variable: Callable[[str, str, Any], Any]) -> None:
        """Creates the variables: `make_variable(name, dtype, initial_value)`."""
        self.step_loss = make_variable("step_loss", "float32", 0.0)
        self.recorded = make_variable("step_loss_recorded", "bool", False)
        self.total = make_variable("applied_loss_total", "float32", 0.0)
        self.steps = make_variable("applied_loss_steps", "int64", 0)
        self.built = True

    def record(self, loss: Any) -> None:
        """Keeps this step's loss (before scaling) until `settle`."""
        if self.built:
            self.step_loss.assign(keras.ops.cast(keras.ops.mean(loss), "float32"))
            self.recorded.assign(True)

    def settle(self, taken: Any) -> None:
        """Adds the recorded loss if the step's gradients were taken (with
        gradient accumulation: if the micro-batch's were finite)."""
        if not self.built:
            return
        take = keras.ops.logical_and(taken, self.recorded.value)
        self.total.assign_add(keras.ops.where(take, self.step_loss.value, 0.0))
        self.steps.assign_add(keras.ops.cast(take, self.steps.dtype))
        self.recorded.assign(False)

    def variables(self) -> list:
        """Its variables (none before `build`)."""
        if not self.built:
            return []
        return [self.step_loss, self.recorded, self.total, self.steps]

    def reset(self) -> None:
        if self.built:
            self.total.assign(0.0)
            self.steps.assign(0)

    def mean(self):
        """The mean loss of the applied steps (NaN with none)."""
        return self.total.value / keras.ops.cast(self.steps.value, "float32")


def logged(model: Any, metric: Any, opt: Any):
    """The `applied_loss` kmp's telemetry `metric` logs for `model`, trained
    by `opt` alone: the mean loss of the steps applied this epoch (NaN before
    the first). None where it is not logged: several replicas, no single
    Keras `loss` beside it, or no loss recorded by `opt.scale_loss`."""
    if model is None or distribute.replicas() > 1:
        return None
    trackers = [
        m
        for m in model.metrics
        if m is not metric and m.name == "loss" and isinstance(m, keras.metrics.Mean)
    ]
    applied = opt._applied_loss
    if len(trackers) != 1 or not applied.built or not opt._loss_recorded:
        return None
    return applied.mean()
