"""`kmp.compile`: `model.compile` with kmp's precision rules applied first."""

from __future__ import annotations

from typing import Any

import keras

from kmp import fused
from kmp import hardware
from kmp import planning
from kmp import policy as policy_lib
from kmp import telemetry
from kmp.optimizer import LossScaleOptimizer


def compile(
    model: keras.Model, *, fused_update: bool | None = None, **compile_kwargs: Any
) -> keras.Model:
    """Applies kmp's precision rules to `model`, then calls `model.compile`.

    Use it in place of `model.compile(...)`: it takes the same arguments and
    applies kmp's precision rules under a 16-bit policy (softmax, attention
    scores under float16 and the model's outputs in float32; no layer's
    interface with your code changes; see `kmp.rules`), without a second
    call to remember. Under a float16 model
    policy the optimizer is wrapped in `kmp.LossScaleOptimizer` (unless it
    already is a loss-scale optimizer), so Keras's own wrapper is not used.

    Under a 16-bit policy the float32 weight update is fused by XLA where
    that helps (`kmp.fused`: machines without GPUs or TPUs). So under
    bfloat16 an optimizer of a class in `kmp.fused.TESTED` is wrapped too,
    in a pass-through `kmp.LossScaleOptimizer` (mode `'none'`) that only
    fuses the update, on every machine alike, so that saved optimizer state
    stays portable.

    Args:
        model: The Keras model to compile.
        fused_update: `None` (default) fuses the optimizer update under a
            16-bit policy where that helps (Keras optimizers of the classes
            in `kmp.fused.TESTED`); `True` fuses it under any policy (float32
            too); `False` never, and under bfloat16 leaves the optimizer
            unwrapped. For an optimizer that already is a
            `kmp.LossScaleOptimizer`, set it there instead.
        **compile_kwargs: Passed to `model.compile` unchanged.

    Returns:
        The same model, compiled.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(3, activation="softmax")])
    >>> model = kmp.compile(model, optimizer="adam",
    ...                     loss="sparse_categorical_crossentropy")
    >>> model.layers[-1].compute_dtype
    'float32'

    See also: `kmp.prepare`, `kmp.precision_report`.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "kmp.compile() expects a keras.Model. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    fused.check_setting(fused_update)
    optimizer = compile_kwargs.get("optimizer", "rmsprop")
    wrapped = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if wrapped and fused_update is not None:
        raise ValueError(
            "kmp.compile(fused_update=...) applies when kmp wraps the "
            "optimizer, but the optimizer is already a "
            f"{type(optimizer).__name__}. Set it there instead: "
            "kmp.LossScaleOptimizer(inner, fused_update=...)."
        )
    planning.prepare(model)
    policy = policy_lib.get(model.dtype_policy)
    # The fast-path settings follow the model being compiled (grappler reads
    # them when `fit` first runs), also when it was built in a policy_scope.
    hardware.apply_fast_paths(policy.compute_dtype)
    if not wrapped:
        if isinstance(optimizer, (str, dict)):  # resolve it once, as Keras would
            optimizer = keras.optimizers.get(optimizer)
        compile_kwargs["optimizer"] = _wrap(optimizer, policy, fused_update)
    model.compile(**compile_kwargs)
    telemetry.attach(model)
    return model


def _wrap(optimizer: Any, policy: policy_lib.Policy, fused_update: bool | None):
    """The optimizer `kmp.compile` hands to Keras for this policy."""
    if policy.needs_loss_scaling:
        return LossScaleOptimizer(optimizer, mode="dynamic", fused_update=fused_update)
    if fused_update or (
        fused_update is None
        and policy.compute_dtype == "bfloat16"
        and fused.is_tested(optimizer)
    ):
        # A pass-through that only fuses the update. The wrapping does not
        # depend on the machine (saved optimizer variables stay portable);
        # whether the update is fused is decided when it is traced.
        return LossScaleOptimizer(optimizer, mode="none", fused_update=fused_update)
    return optimizer
