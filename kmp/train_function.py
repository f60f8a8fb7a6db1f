"""kmp's part in `fit`'s train function: Keras's own function, run as it is,
with what kmp can only do once the model is built and once a step's logs
are known.

`kmp.compile` (and `kmp.telemetry.attach`) set `model.train_function` to a
`TrainFunction`, which Keras's `make_train_function` then keeps (it makes a
function only where there is none). At its first call, inside `fit` after
Keras has built the model, it:

* completes the precision plan of a model that was not built when it was
  compiled (a subclassed model: which layer produces its output is read
  from a trace of its `call`), then has Keras make its own train function
  and calls it from then on;

and after each call from `fit`, where the step's logs lack kmp's telemetry
(a `train_step` that returns its own dict), it adds the loss scale and the
skipped steps, read from the optimizers' variables after the step (no
device sync: the values travel with the logs, which Keras reads when it
reads the loss). `skipped_steps` (this epoch) is added only where Keras
resets kmp's telemetry metric at each epoch start (it is among
`model.metrics`; a model that overrides `metrics` gets
`skipped_steps_total`). `train_on_batch` returns the step's logs as the
`train_step` wrote them.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import tensorflow as tf

from kmp import planning
from kmp import telemetry


class TrainFunction:
    """`model.train_function` as kmp sets it (see the module docstring).

    Args:
        model: The model compiled.
        complete_plan: Whether to apply kmp's precision plan again at the
            first call (the model was not built when it was compiled).
    """

    def __init__(self, model: keras.Model, complete_plan: bool):
        self._model = weakref.ref(model)
        self._complete_plan = complete_plan
        self._inner = None
        self._adds: bool | None = None  # decided at the first step from fit
        self._per_epoch = False

    def __call__(self, iterator: Any) -> Any:
        model = self._model()
        if self._inner is None:
            self._inner = self._keras_function(model, iterator)
        logs = self._inner(iterator)
        # fit hands over a tf.data iterator (train_on_batch a generator).
        from_fit = isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        )
        if not from_fit or not isinstance(logs, dict):
            return logs
        if self._adds is None:
            self._per_epoch = telemetry.metric_in_metrics(model)
            wanted = telemetry.step_logs(model, self._per_epoch)
            self._adds = any(key not in logs for key in wanted)
        if not self._adds:
            return logs
        extra = telemetry.step_logs(model, self._per_epoch)
        return {**logs, **{k: v for k, v in extra.items() if k not in logs}}

    def _keras_function(self, model: keras.Model, iterator: Any):
        if self._complete_plan:
            if not model.built:
                _build(model, iterator)
            planning.prepare(model)  # built now: the plan can read its call
        model.train_function = None
        try:
            model.make_train_function()
            inner = model.train_function
        finally:
            model.train_function = self
        return inner


def _build(model: keras.Model, iterator: Any) -> None:
    """Builds `model` for the inputs `iterator` yields, as Keras builds a
    model from its saved input shape (`build_from_config`: a symbolic call,
    nothing runs), where they are one tensor. Without a strategy, Keras
    builds a model only inside its first traced step, after the layers'
    policies were read."""
    spec = getattr(iterator, "element_spec", None)
    if spec is None:
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(spec)
    if isinstance(x, tf.TensorSpec):
        model.build_from_config({"input_shape": tuple(x.shape)})


def install(model: keras.Model, complete_plan: bool = False) -> None:
    """Sets `model.train_function` to a `TrainFunction` (after `compile`,
    which clears it)."""
    model.train_function = TrainFunction(model, complete_plan)
