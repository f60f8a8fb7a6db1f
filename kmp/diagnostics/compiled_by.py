"""Whether a model was compiled by `kmp.compile`, and saying so once when a
kmp tool meets one that was not.

Keras's `model.compile` cannot be intercepted: after `kmp.set_policy(...)`,
a plain `model.compile(...)` trains with Keras's own loss-scale wrapper
(under `mixed_float16`) or the bare optimizer, without kmp's optimizer or
telemetry, and nothing fails. kmp's callbacks and debugging tools are where
such a model shows up, so they call `note_compiled_without_kmp`, which logs
one warning per model (logger `"kmp"`) naming what the model trains with and
the one-line change.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import keras

from kmp.scaling import optimizer as optimizer_lib
from kmp.scaling import registry

logger = logging.getLogger("kmp")

# The models already named, so that each is named once.
_noted: weakref.WeakSet = weakref.WeakSet()


def compiled_without_kmp(model: Any) -> bool:
    """Whether `model` is compiled with an optimizer but none of its
    optimizers is a `kmp.LossScaleOptimizer` (Keras's `model.compile`). An
    uncompiled model, or one compiled without an optimizer, is not."""
    if not getattr(model, "compiled", False):
        return False
    if any(
        isinstance(o, optimizer_lib.LossScaleOptimizer)
        for o in registry.optimizers_of(model).values()
    ):
        # kmp.compile wrapped the optimizers (a GAN's compile(d_optimizer=...,
        # g_optimizer=...) may leave model.optimizer as Keras's default).
        return False
    opt = getattr(model, "optimizer", None)
    return opt is not None


def _optimizer_is(opt: Any) -> str:
    # Never kmp's here (see compiled_without_kmp).
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return f"{registry.describe(opt)} (no floor under the loss scale)"
    return f"{registry.describe(opt)} alone (non-finite steps are applied)"


def note_compiled_without_kmp(model: Any, tool: str) -> bool:
    """Logs, once per model, that `tool` met a model compiled without kmp.

    Args:
        model: The model the tool was given.
        tool: The tool's name as the user wrote it, for the message.

    Returns:
        Whether the model is compiled without kmp (see
        `compiled_without_kmp`), logged now or before.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> note_compiled_without_kmp(model, "my tool")
    True
    """
    if not compiled_without_kmp(model):
        return False
    if model in _noted:
        return True
    _noted.add(model)
    logger.warning(
        "%s: model %r was compiled with model.compile, not kmp.compile: its "
        "optimizer (model.optimizer) is %s, and kmp's telemetry (loss scale and "
        "skipped steps in the logs) is not attached. kmp.compile(model, ...) "
        "takes the same arguments and gives it kmp's precision rules and "
        "optimizer. A model whose own compile takes kmp.LossScaleOptimizers: "
        "name them with kmp.telemetry.attach(model, optimizers={...}).",
        tool,
        getattr(model, "name", type(model).__name__),
        _optimizer_is(model.optimizer),
    )
    return True
