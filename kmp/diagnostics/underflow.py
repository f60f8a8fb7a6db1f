"""`kmp.debug.gradient_underflow`: how many of each layer's gradient values
float16 loses at the model's current loss scale, and what helps.

The measure itself is `kmp.backend.underflow` (one float32 forward and
backward pass on a batch; nothing of the model changes); this reads the
scale from the model's optimizer.
"""

from __future__ import annotations

from typing import Any

import keras

from kmp.backend import underflow as underflow_lib
from kmp.scaling import telemetry


def current_scale(model: keras.Model) -> float:
    """The model's optimizer's loss scale now (1.0 where it scales nothing)."""
    variable = telemetry.loss_scale_of(getattr(model, "optimizer", None))
    return 1.0 if variable is None else float(keras.ops.convert_to_numpy(variable))


def gradient_underflow(
    model: keras.Model,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    scale: float | None = None,
) -> underflow_lib.Underflow:
    """Measures, per layer that computes in float16 (or bfloat16), the
    fraction of its weights' gradient values that its dtype flushes to zero
    at the loss scale, the fraction left subnormal, and how much larger the
    scale could grow before its largest gradient overflows.

    One float32 forward and backward pass of the model's own loss on the
    batch (Keras's stateless call: weights, normalization statistics and
    metrics are left as they are); its cost is about one training step's.
    `print()` the result for a table and what helps the layer that loses
    the most: a larger scale where its gradients have room, float32 where
    they span more than float16's range.

    Args:
        model: A compiled Keras model.
        x: A batch of inputs (a few hundred samples say enough).
        y: Their targets.
        sample_weight: Optional sample weights.
        scale: The loss scale to measure at; by default the model's
            optimizer's current one (1.0 without loss scaling).

    Returns:
        An `Underflow`: `.layers` per layer, `.flushed_fraction` over all,
        `.advice()`.

    Raises:
        ValueError: if the model is not compiled, or `scale` is not a
            positive finite number.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d"),
    ...                           keras.layers.Dense(1, name="head")])
    >>> model = kmp.compile(model, optimizer="sgd", loss="mse")
    >>> x, y = np.full((8, 4), 1e-3), np.zeros((8, 1))
    >>> model.get_layer("d").set_weights([np.full((4, 1), 1e-3), np.zeros(1)])
    >>> model.get_layer("head").set_weights([np.ones((1, 1)), np.zeros(1)])
    >>> u = kmp.debug.gradient_underflow(model, x, y, scale=1.0)
    >>> print(u)  # doctest: +ELLIPSIS
    Gradient underflow at loss scale 1
    layer  class  computes  flushed  subnormal  headroom
    ...
    d      Dense  float16   80.0%    20.0%      8.19e+09x
    head   Dense  float16   50.0%    50.0%      8.19e+09x
    (of each layer's nonzero gradient values: ...)
    'd' loses 80.0% of its gradient values to zero in float16 at loss scale 1; a scale
    up to 8.19e+09x larger keeps its largest gradient in range. ...
    >>> kmp.debug.gradient_underflow(model, x, y).flushed_fraction  # at its scale
    0.0
    """
    if scale is None:
        scale = current_scale(model)
    return underflow_lib.gradient_underflow(model, x, y, scale, sample_weight)
