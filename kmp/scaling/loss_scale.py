"""The loss scale: `LossScale`, the one object that holds a scale (the
variables of its `LossScaleState`) and scales, unscales and adjusts.

`LossScale` has three methods: `scale(loss)`, `unscale(grads)` and
`adjust(finite)`, which moves the state by `kmp.scaling.state.next_state`.
The optimizer (inside `fit`), the scaled gradient tape, distributed training
and `kmp.debug` all go through it; nothing else changes or applies a loss
scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras

from kmp._base import warn as _warn
from kmp.backend import sparse
from kmp.scaling.config import DYNAMIC
from kmp.scaling.config import NONE
from kmp.scaling.config import STATIC
from kmp.scaling.config import LossScaleConfig
from kmp.scaling.state import LossScaleState
from kmp.scaling.state import next_state

# The LossScaleState fields each mode can change (the others stay put).
_MOVING = {
    DYNAMIC: {
        "scale",
        "good_steps",
        "hysteresis_left",
        "skipped_total",
        "consecutive_skips",
        "last_finite",
    },
    STATIC: {"good_steps", "skipped_total", "consecutive_skips", "last_finite"},
    NONE: {"skipped_total", "consecutive_skips", "last_finite"},
}

# The optimizer's public name for each LossScaleState field.
PUBLIC_NAMES = {
    "scale": "loss_scale",
    "good_steps": "good_steps",
    "hysteresis_left": "hysteresis_left",
    "skipped_total": "skipped_steps_total",
    "consecutive_skips": "consecutive_skips",
    "last_finite": "last_step_finite",
}


class LossScale:
    """One loss scale: its `LossScaleConfig`, the variables that hold its
    `LossScaleState`, and the three things done with them.

    * `scale(loss)`: `loss * scale` (the loss itself when the mode is
      `'none'`);
    * `unscale(grads, variables)`: the gradients divided by the scale, in
      float32 (float16 gradients would overflow at scales of 2**16 and up),
      leaving the gradients of variables Keras overwrites with their
      "gradient" (float8 scales and amax histories) alone;
    * `adjust(finite)`: the step's outcome moves the state (`next_state`).

    `kmp.LossScaleOptimizer` owns one; `kmp.ScaledGradientTape` and
    `kmp.debug` use the optimizer's. Like JMP's `DynamicLossScale`, but its
    state is variables, so that `fit`'s compiled step updates it in place.

    Args:
        config: The `LossScaleConfig`.
        make_variable: Creates one state variable: called as
            `make_variable(name, dtype, initial_value)` (the optimizer's
            `add_variable`, so the state is saved with it).

    Example:

    >>> scale = kmp.scaling.loss_scale.LossScale(
    ...     kmp.scaling.config.LossScaleConfig(initial_scale=8.0),
    ...     lambda name, dtype, value: keras.Variable(value, dtype=dtype, name=name))
    >>> float(scale.scale(keras.ops.convert_to_tensor(2.0)))
    16.0
    >>> [float(g) for g in scale.unscale([keras.ops.convert_to_tensor(16.0)])]
    [2.0]
    >>> scale.adjust(False)
    >>> float(scale.value), int(scale.state.skipped_total)
    (4.0, 1)
    """

    def __init__(self, config: LossScaleConfig, make_variable: Callable):
        if not isinstance(config, LossScaleConfig):
            raise TypeError(
                "LossScale expects a LossScaleConfig. Received: "
                f"{config!r} (of type {type(config).__name__})."
            )
        self.config = config
        values = LossScaleState.initial_values(config)
        self.state = LossScaleState(
            *(
                make_variable(PUBLIC_NAMES[field], dtype, value)
                for (field, dtype), value in zip(
                    LossScaleState.SPEC, values, strict=True
                )
            )
        )

    @property
    def scaling(self) -> bool:
        """Whether the loss is scaled at all (mode is not `'none'`)."""
        return self.config.mode != NONE

    @property
    def value(self):
        """The scale's variable (1.0 in mode `'none'`)."""
        return self.state.scale

    def scale(self, loss):
        """Returns `loss * scale` (`loss` itself in mode `'none'`)."""
        if not self.scaling:
            return loss
        loss = keras.ops.convert_to_tensor(loss)
        return loss * keras.ops.cast(self.state.scale, loss.dtype)

    def unscale(self, grads, variables=None, factor=None) -> list:
        """Returns the gradients times `factor` (default `1 / scale`), in
        float32. `None` gradients, and those of variables with
        `overwrite_with_gradient` (Keras's float8 scales and histories, which
        Keras overwrites with their "gradient"), are returned as they are."""
        grads = list(grads)
        if not self.scaling and factor is None:
            return grads
        if factor is None:
            factor = 1.0 / keras.ops.convert_to_tensor(self.state.scale)
        if variables is None:
            variables = [None] * len(grads)

        def times(values):
            return keras.ops.cast(
                keras.ops.cast(values, "float32") * factor, values.dtype
            )

        out = []
        for g, v in zip(grads, variables, strict=True):
            if g is None or getattr(v, "overwrite_with_gradient", False):
                out.append(g)
            elif sparse.is_sparse(g):  # its rows are unscaled
                out.append(sparse.map_values(g, times))
            else:
                out.append(times(g))
        return out

    def adjust(self, finite, keep_scale=False) -> None:
        """Moves the state after one optimizer step whose gradients were
        (`finite=True`) or were not all finite (`keep_scale`: see
        `next_state`). Only the fields the mode can change are written (in
        mode `'none'`: the three skip counters)."""
        new = next_state(self.config, self.state, finite, keep_scale)
        moving = _MOVING[self.config.mode]
        for field in dataclasses.fields(self.state):
            if field.name in moving:
                getattr(self.state, field.name).assign(getattr(new, field.name))


SIXTEEN_BIT_LOSS = (
    "The loss is {dtype}: kmp scales it rather than refusing it (a scaled loss "
    "is float32), but it was computed in {dtype}, which rounds it and can "
    "overflow or hit log(0) before any scaling, and its backward pass starts "
    "in {dtype}: under float16 a loss scale of 2**16 or more overflows there, "
    "and each time the scale grows that far one step is skipped and the scale "
    "lowered. Compute the loss from float32 predictions: tf.cast(y_pred, "
    "'float32') before the loss."
)


def check_loss(loss, mode: str, owner: object) -> bool:
    """Refuses a loss that cannot be scaled (not floating point). Returns
    True for a 16-bit loss while scaling, and warns of it once per `owner`
    (its optimizer: `SIXTEEN_BIT_LOSS`)."""
    dtype = getattr(loss, "dtype", None)
    if dtype is None:
        return False
    dtype = keras.backend.standardize_dtype(dtype)
    if not keras.backend.is_float_dtype(dtype):
        raise TypeError(
            f"The loss must be a floating-point tensor to be scaled. Received a "
            f"loss of dtype {dtype}. Cast it first: keras.ops.cast(loss, 'float32')."
        )
    sixteen_bit = mode != NONE and dtype not in ("float32", "float64")
    if sixteen_bit and _warn.once(owner, "16-bit loss"):
        _warn.warn(SIXTEEN_BIT_LOSS.format(dtype=dtype))
    return sixteen_bit
