"""The loss-scale state machine: `LossScaleState` (the fields, as tensors or
the variables that hold them) and `next_state`, the one transition
function. Written with `keras.ops`."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from kmp.scaling.config import DYNAMIC
from kmp.scaling.config import NONE
from kmp.scaling.config import LossScaleConfig

# Counters are int64 and saturate here instead of wrapping (JAX without
# x64 makes them int32: they saturate at that type's largest value).
COUNTER_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """The state of the machine: tensors (or the variables that hold them).

    Attributes:
        scale: float32 scalar, the loss scale.
        good_steps: int64, finite steps since the scale last changed.
        hysteresis_left: int64, overflows still tolerated before a backoff.
        skipped_total: int64, all skipped steps (saturating).
        consecutive_skips: int64, skipped steps in a row (saturating).
        last_finite: bool, whether the last step's gradients were finite.
    """

    scale: Any
    good_steps: Any
    hysteresis_left: Any
    skipped_total: Any
    consecutive_skips: Any
    last_finite: Any

    # (name, dtype) of each field, in order.
    SPEC = (
        ("scale", "float32"),
        ("good_steps", "int64"),
        ("hysteresis_left", "int64"),
        ("skipped_total", "int64"),
        ("consecutive_skips", "int64"),
        ("last_finite", "bool"),
    )

    @staticmethod
    def initial_values(config: LossScaleConfig) -> tuple:
        """The initial field values as Python scalars, in `SPEC` order."""
        scale = 1.0 if config.mode == NONE else config.initial_scale
        return (scale, 0, config.hysteresis, 0, 0, True)

    @classmethod
    def initial(cls, config: LossScaleConfig) -> LossScaleState:
        """The initial state, as tensors."""
        values = cls.initial_values(config)
        return cls(
            *(
                keras.ops.convert_to_tensor(v, dtype)
                for v, (_, dtype) in zip(values, cls.SPEC, strict=True)
            )
        )

    def fields(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _saturating_increment(counter):
    largest = np.iinfo(keras.backend.standardize_dtype(counter.dtype)).max
    return keras.ops.where(counter < largest, counter + 1, counter)


def next_state(
    config: LossScaleConfig,
    state: LossScaleState,
    grads_finite: Any,
    keep_scale: Any = False,
) -> LossScaleState:
    """The loss-scale transition: the next state after one optimizer step.

    The algorithm, exactly (a plain-Python copy of it lives in the tests and
    is compared with this function over random step sequences)::

        if grads_finite:
            consecutive_skips = 0
            hysteresis_left = hysteresis
            good_steps += 1                      # saturating
            if mode == "dynamic" and good_steps >= dynamic_growth_steps:
                scale = min(scale * growth_factor, max_scale)
                good_steps = 0
        else:
            skipped_total += 1                   # saturating
            consecutive_skips += 1               # saturating
            good_steps = 0
            if mode == "dynamic":
                if hysteresis_left <= 1:
                    scale = max(scale * backoff_factor, min_scale)
                else:
                    hysteresis_left -= 1
        last_finite = grads_finite

    With `keep_scale` true on a non-finite step (a forward overflow that
    `kmp.callbacks.OverflowHealer` handles: a lower scale cannot fix it),
    the step is skipped and counted, and `scale`, `good_steps` and
    `hysteresis_left` stay as they were.

    In `'static'` mode the scale never changes; in `'none'` mode (no loss
    scaling) the scale stays 1 and the counters count skipped steps as in
    `'static'`: a non-finite step is skipped under every mode. The scale
    stays in `[min_scale, max_scale]`, so it is never 0, inf or NaN. The
    scale is a float32: `scale * growth_factor` is rounded to float32.

    Args:
        config: A `LossScaleConfig`.
        state: A `LossScaleState` of tensors or variables.
        grads_finite: A scalar bool (tensor): were all gradients finite?
        keep_scale: A scalar bool (tensor): on a non-finite step, leave the
            scale and its counters alone (see above).

    Returns:
        The next `LossScaleState`, of tensors. Works eagerly and in graphs.
    """
    ops = keras.ops
    finite = ops.convert_to_tensor(grads_finite, "bool")
    scale = ops.convert_to_tensor(state.scale, "float32")
    good = ops.convert_to_tensor(state.good_steps, "int64")
    hyst = ops.convert_to_tensor(state.hysteresis_left, "int64")
    skipped = ops.convert_to_tensor(state.skipped_total, "int64")
    consecutive = ops.convert_to_tensor(state.consecutive_skips, "int64")

    good_after = _saturating_increment(good)
    zero = ops.zeros_like(good)
    if config.mode == DYNAMIC:
        grow = ops.logical_and(finite, good_after >= config.dynamic_growth_steps)
        grown = ops.minimum(scale * config.growth_factor, config.max_scale)
        backoff_now = ops.logical_and(ops.logical_not(finite), hyst <= 1)
        backed_off = ops.maximum(scale * config.backoff_factor, config.min_scale)
        new_scale = ops.where(grow, grown, ops.where(backoff_now, backed_off, scale))
        new_good = ops.where(finite, ops.where(grow, zero, good_after), zero)
        new_hyst = ops.where(
            finite,
            ops.convert_to_tensor(config.hysteresis, "int64"),
            ops.where(hyst <= 1, hyst, hyst - 1),
        )
    else:  # static, and none (whose scale is 1)
        new_scale = scale
        new_good = ops.where(finite, good_after, zero)
        new_hyst = hyst
    keep = ops.logical_and(
        ops.logical_not(finite), ops.convert_to_tensor(keep_scale, "bool")
    )
    new_scale = ops.where(keep, scale, new_scale)
    new_good = ops.where(keep, good, new_good)
    new_hyst = ops.where(keep, hyst, new_hyst)
    return LossScaleState(
        scale=new_scale,
        good_steps=new_good,
        hysteresis_left=new_hyst,
        skipped_total=ops.where(finite, skipped, _saturating_increment(skipped)),
        consecutive_skips=ops.where(
            finite, ops.zeros_like(consecutive), _saturating_increment(consecutive)
        ),
        last_finite=finite,
    )
