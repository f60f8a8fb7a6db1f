"""Which optimizers kmp reports for each model: the ones `kmp.compile`
wrapped (by argument name) or `kmp.telemetry.attach` was given, else
`model.optimizer`."""

from __future__ import annotations

import weakref
from typing import Any

import keras


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
