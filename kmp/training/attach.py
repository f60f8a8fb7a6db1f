"""`kmp.telemetry.attach`: a compiled model made to log the loss scale and
skipped steps in `fit` (kmp's telemetry metric among its metrics, and kmp's
train function set)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import keras

from kmp.backend import outputs
from kmp.internals import keras_private
from kmp.precision import traversal
from kmp.scaling import registry
from kmp.scaling.telemetry import LossScaleTelemetry
from kmp.scaling.telemetry import metric_in_metrics
from kmp.scaling.telemetry import step_logs
from kmp.training import train_function

logger = logging.getLogger("kmp")


def _track(model: keras.Model, metric: LossScaleTelemetry) -> None:
    """Adds `metric` to `model`'s metrics.

    Keras never locks the state of a Sequential or Functional model (their
    layers are their state), except that `Model.quantize` leaves the model's
    tracker locked when it returns; for those models the lock is lifted for
    this one attribute and put back. A subclassed model's lock (set when it
    is built) is respected: the caller warns.
    """
    if not traversal.is_graph(model):
        model.kmp_loss_scale_telemetry = metric
        return
    with keras_private.tracker_unlocked(model):
        model.kmp_loss_scale_telemetry = metric


def attach(
    model: keras.Model,
    complete_plan: bool = False,
    *,
    optimizers: Mapping[str, Any] | None = None,
) -> keras.Model:
    """Makes `fit` log the loss scale and skipped steps of `model`'s
    loss-scaling optimizers (kmp's, or Keras's own wrapper's scale).
    Idempotent; `kmp.compile` calls it. Works before or after training and
    after `keras.models.load_model`: a train step already traced is traced
    again, with the telemetry, at the next `fit`. A `train_step` that
    returns its own dict, and a model whose state Keras has locked, get them
    from kmp's train function, which `attach` sets. `predict` then returns
    the model's 16-bit outputs cast to float32, as after `kmp.compile`.

    The optimizers reported are the last named (by `kmp.compile`, which
    names the ones it wrapped, or as `optimizers` here), else
    `model.optimizer`. A model whose own `compile` takes optimizers (a GAN's
    `d_optimizer` and `g_optimizer`), compiled without `kmp.compile`, trains
    with optimizers kmp cannot find: name them in `optimizers`. Where the
    first training step (or the first after `optimizers` changed) applies a
    `kmp.LossScaleOptimizer` that is not among those reported, kmp warns
    (not under a `tf.distribute` strategy, whose replicas apply in threads
    of their own: there kmp does not check).

    Args:
        model: A compiled Keras model.
        complete_plan: For `kmp.compile`: the train function applies kmp's
            precision plan again once `fit` has built the model.
        optimizers: The optimizers `model` trains with, by the label that
            prefixes their logs where there are several (`{"d_optimizer":
            model.d_optimizer, "g_optimizer": model.g_optimizer}` logs
            `d_optimizer_loss_scale`, ...); they replace those reported
            before.

    Returns:
        `model`.

    Raises:
        TypeError: if `optimizers` is not a non-empty dict of Keras
            optimizers.
        ValueError: if a label is not a Python identifier, or an optimizer
            is the one `kmp.compile` wrapped (pass its wrapper).

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
    changed = False
    if optimizers is not None:
        before = registry.optimizers_of(model)
        given = _checked(optimizers, before)
        changed = given.keys() != before.keys() or any(
            given[label] is not before[label] for label in given
        )
        registry.register(model, given)
    refused = _add_metric(model)
    if refused:
        logger.debug(
            "kmp.telemetry: %s's state is locked (%s): the train function adds "
            "the telemetry to its logs, without a per-epoch skip count.",
            type(model).__name__,
            refused,
        )
    train_function.install(model, complete_plan, step_logs, metric_in_metrics)
    outputs.install(model)  # its predict casts 16-bit outputs to float32
    if changed:  # a step traced before reports the optimizers it read then
        model.train_function.optimizers_changed()  # kmp's, installed above
    return model


def _checked(optimizers: Any, before: dict[str, Any]) -> dict[str, Any]:
    """`optimizers` as a dict of labels to Keras optimizers, or an error
    (`before`: those reported now, for an optimizer kmp wrapped)."""
    if not isinstance(optimizers, Mapping) or not optimizers:
        raise TypeError(
            "optimizers must be a non-empty dict of labels to the optimizers "
            "the model trains with, such as {'d_optimizer': model.d_optimizer, "
            f"'g_optimizer': model.g_optimizer}}. Received: {optimizers!r}."
        )
    for label, optimizer in optimizers.items():
        if not isinstance(label, str) or not label.isidentifier():
            raise ValueError(
                "Each label in optimizers names the optimizer's logs "
                "('d_optimizer' logs d_optimizer_loss_scale): a Python "
                f"identifier such as 'd_optimizer'. Received: {label!r}."
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "optimizers maps each label to a Keras optimizer (a "
                "kmp.LossScaleOptimizer, or any keras.optimizers.Optimizer). "
                f"Received {label!r}: {optimizer!r} (of type "
                f"{type(optimizer).__name__})."
            )
        for name, wrapper in before.items():
            if getattr(wrapper, "inner_optimizer", None) is optimizer:
                raise ValueError(
                    f"optimizers[{label!r}] is the optimizer that "
                    f"{type(wrapper).__name__} {name!r} wraps: the model "
                    "trains with the wrapper, whose loss scale and skipped "
                    f"steps are logged. Pass the wrapper (as {name!r}, "
                    f"model.{name} where kmp.compile wrapped it)."
                )
    return dict(optimizers)


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
