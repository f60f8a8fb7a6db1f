"""`kmp.compile`: `model.compile` with kmp's precision rules applied first."""

from __future__ import annotations

from typing import Any

import keras

from kmp import hardware
from kmp import policy as policy_lib
from kmp import rules
from kmp import telemetry
from kmp.optimizer import LossScaleOptimizer


def compile(model: keras.Model, **compile_kwargs: Any) -> keras.Model:
    """Applies kmp's precision rules to `model`, then calls `model.compile`.

    Use it in place of `model.compile(...)`: it takes the same arguments and
    makes sure that numerically sensitive layers (softmax, normalization,
    attention scores, softmax/sigmoid outputs) compute in float32 under a
    16-bit policy, without a second call to remember. Under a float16 model
    policy the optimizer is wrapped in `kmp.LossScaleOptimizer` (unless it
    already is a loss-scale optimizer), so Keras's own wrapper is not used.

    Args:
        model: The Keras model to compile.
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
    rules.prepare(model)
    # The fast-path settings follow the model being compiled (grappler reads
    # them when `fit` first runs), also when it was built in a policy_scope.
    hardware.apply_fast_paths(policy_lib.get(model.dtype_policy).compute_dtype)
    optimizer = compile_kwargs.get("optimizer", "rmsprop")
    if policy_lib.get(model.dtype_policy).needs_loss_scaling and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        compile_kwargs["optimizer"] = LossScaleOptimizer(optimizer, mode="dynamic")
    model.compile(**compile_kwargs)
    telemetry.attach(model)
    return model
