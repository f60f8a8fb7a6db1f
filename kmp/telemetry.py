"""Loss-scale telemetry in `fit` logs: the scale and skipped steps, per epoch,
in `History` and the progress bar, with no device sync inside the step.

The optimizer keeps the telemetry as variables; `LossScaleTelemetry` is a
Keras metric whose `result()` only reads them. Keras calls `result()` inside
the compiled train step, so the values travel with the loss, and resets the
metric at each epoch start, which is when the epoch's skip count starts. In
evaluation steps it reports nothing, so `model.evaluate` returns what it
would without kmp.

A model loaded with `keras.models.load_model` has no telemetry metric (it is
not part of the saved model): call `kmp.telemetry.attach(model)` again.
"""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf

from kmp import optimizer as optimizer_lib

LOG_KEYS = ("loss_scale", "skipped_steps", "skipped_steps_total")


class LossScaleTelemetry(keras.metrics.Metric):
    """Reports `loss_scale`, `skipped_steps` (this epoch) and
    `skipped_steps_total` of a model's `kmp.LossScaleOptimizer`.

    Attach it with `kmp.telemetry.attach(model)`; `kmp.compile` does that for
    you. Under any other optimizer it reports nothing.
    """

    def __init__(self, model: keras.Model, name: str = "kmp_loss_scale"):
        super().__init__(name=name)
        self._model_ref = weakref.ref(model)
        self._epoch_start = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="epoch_start"
        )

    def _optimizer(self) -> optimizer_lib.LossScaleOptimizer | None:
        # Only a scaling optimizer has a scale to report: a pass-through
        # (mode 'none', as kmp.compile adds under bfloat16) skips nothing.
        return optimizer_lib.scaling_of_model(self._model_ref())

    def update_state(self, *args, **kwargs):
        """Nothing to accumulate: the optimizer holds the state."""

    def reset_state(self):
        opt = self._optimizer()
        if opt is not None:
            self._epoch_start.assign(opt.skipped_steps_total)

    def result(self):
        opt = self._optimizer()
        # Only in training steps: evaluate() keeps returning what it did.
        if opt is None or not opt.in_training_step():
            return {}
        total = tf.convert_to_tensor(opt.skipped_steps_total)
        return {
            "loss_scale": tf.convert_to_tensor(opt.loss_scale),
            "skipped_steps": total - tf.convert_to_tensor(self._epoch_start),
            "skipped_steps_total": total,
        }


def attach(model: keras.Model) -> keras.Model:
    """Makes `fit` log the loss scale and skipped steps of `model`'s
    `kmp.LossScaleOptimizer`. Idempotent; `kmp.compile` calls it.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model = kmp.compile(model, optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    >>> sorted(k for k in history.history if "skip" in k or "scale" in k)
    ['loss_scale', 'skipped_steps', 'skipped_steps_total']
    """
    if not any(isinstance(m, LossScaleTelemetry) for m in model.metrics):
        model.kmp_loss_scale_telemetry = LossScaleTelemetry(model)
    return model
