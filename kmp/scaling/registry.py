"""Which optimizers kmp reports for each model: the ones `kmp.compile`
wrapped (by argument name) or `kmp.telemetry.attach` was given, else
`model.optimizer`."""

from __future__ import annotations

import weakref
from typing import Any

import keras

from kmp.scaling import optimizer as optimizer_lib


def optimizers_of(model: keras.Model) -> dict[str, Any]:
    """The optimizers telemetry reports for `model`, by label: the ones
    `kmp.compile` wrapped (by argument name) or `kmp.telemetry.attach` was
    given, else `model.optimizer`."""
    registered = _registered.get(model)
    if registered:
        return dict(registered)
    opt = getattr(model, "optimizer", None)
    return {"optimizer": opt} if opt is not None else {}


# Optimizers kmp.compile wrapped or attach was given, per model: {label:
# optimizer}.
_registered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register(model: keras.Model, optimizers: dict[str, Any]) -> None:
    """Records the optimizers `model` trains with (`kmp.compile`'s wrapped
    ones, or those given to `kmp.telemetry.attach`)."""
    _registered[model] = dict(optimizers)


def describe(optimizer: Any) -> str:
    """`optimizer` in a message: `'a kmp.LossScaleOptimizer around Adam'`,
    `"Keras's own LossScaleOptimizer around RMSprop"`, or its class name."""
    inner = type(getattr(optimizer, "inner_optimizer", None)).__name__
    if isinstance(optimizer, optimizer_lib.LossScaleOptimizer):
        return f"a kmp.LossScaleOptimizer around {inner}"
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return f"Keras's own LossScaleOptimizer around {inner}"
    return type(optimizer).__name__
