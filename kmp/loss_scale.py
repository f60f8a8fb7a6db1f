"""The loss-scale state machine: pure TensorFlow, no Keras.

`next_state(config, state, grads_finite)` is the one transition function. The
optimizer (inside `fit`), the scaled gradient tape and distributed training
all call it; nothing else changes a loss scale.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import Any

import tensorflow as tf

DYNAMIC = "dynamic"
STATIC = "static"
NONE = "none"
MODES = (DYNAMIC, STATIC, NONE)

# Counters are int64 and saturate here instead of wrapping.
COUNTER_MAX = 2**63 - 1


class LossScaleError(ValueError):
    """A loss-scale setting is invalid."""


def _check_positive_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossScaleError(
            f"{name} must be a positive finite number. Received: {name}={value!r} "
            f"(of type {type(value).__name__})."
        )
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise LossScaleError(
            f"{name} must be a positive finite number. Received: {name}={value}. "
            f"Use, for example, {name}=2.0**15."
        )
    return value


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LossScaleError(
            f"{name} must be an integer >= 1. Received: {name}={value!r}. "
            f"Use, for example, {name}=2000 for growth_interval or 1 for hysteresis."
        )
    return int(value)


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """How the loss scale moves. Immutable; validated on construction.

    Args:
        initial_scale: The scale to start from (the fixed scale in static mode).
        growth_factor: Multiplies the scale after `growth_interval` finite
            steps in a row; in (1, inf).
        backoff_factor: Multiplies the scale on an overflow; in (0, 1).
        growth_interval: Finite steps in a row before the scale grows.
        min_scale: The floor; the scale never goes below it.
        max_scale: The ceiling; the scale never goes above it.
        hysteresis: Back off on the N-th consecutive overflow (1 = at once;
            after that, on every further consecutive overflow), as DeepSpeed
            does. A finite step resets it.
        mode: `'dynamic'` (the scale adapts), `'static'` (fixed at
            `initial_scale`; non-finite steps are still skipped) or `'none'`
            (no scaling and no skipping: for bfloat16 and float32).

    Example:

    >>> config = kmp.LossScaleConfig(initial_scale=2.0**10, growth_interval=100)
    >>> config.backoff_factor
    0.5
    """

    initial_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1
    mode: str = DYNAMIC

    def __post_init__(self):
        if self.mode not in MODES:
            raise LossScaleError(
                f"Unknown loss-scale mode {self.mode!r}. Expected one of "
                f"{', '.join(repr(m) for m in MODES)}."
            )
        for name in ("initial_scale", "growth_factor", "backoff_factor"):
            object.__setattr__(
                self, name, _check_positive_finite(name, getattr(self, name))
            )
        for name in ("min_scale", "max_scale"):
            object.__setattr__(
                self, name, _check_positive_finite(name, getattr(self, name))
            )
        for name in ("growth_interval", "hysteresis"):
            object.__setattr__(self, name, _check_count(name, getattr(self, name)))
        if not self.growth_factor > 1:
            raise LossScaleError(
                "growth_factor must be greater than 1 (the scale grows by it). "
                f"Received: growth_factor={self.growth_factor}. Use e.g. 2.0."
            )
        if not self.backoff_factor < 1:
            raise LossScaleError(
                "backoff_factor must be in (0, 1) (the scale shrinks by it). "
                f"Received: backoff_factor={self.backoff_factor}. Use e.g. 0.5."
            )
        if self.min_scale > self.max_scale:
            raise LossScaleError(
                f"min_scale ({self.min_scale}) is greater than max_scale "
                f"({self.max_scale}). Expected min_scale <= max_scale; swap them "
                "or widen the range."
            )
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise LossScaleError(
                f"initial_scale={self.initial_scale} is outside "
                f"[min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]. "
                "Choose an initial scale inside that range."
            )
        if self.max_scale > float(tf.float32.max) / self.growth_factor:
            raise LossScaleError(
                f"max_scale={self.max_scale} is too large: the scale is a float32 "
                "and growing it would overflow. Use max_scale <= 2.0**64."
            )

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaleConfig:
        return cls(**config)


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
        ("scale", tf.float32),
        ("good_steps", tf.int64),
        ("hysteresis_left", tf.int64),
        ("skipped_total", tf.int64),
        ("consecutive_skips", tf.int64),
        ("last_finite", tf.bool),
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
                tf.constant(v, dtype)
                for v, (_, dtype) in zip(values, cls.SPEC, strict=True)
            )
        )

    def fields(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _saturating_increment(counter: tf.Tensor) -> tf.Tensor:
    return tf.where(counter < COUNTER_MAX, counter + 1, counter)


def next_state(
    config: LossScaleConfig, state: LossScaleState, grads_finite: Any
) -> LossScaleState:
    """The loss-scale transition: the next state after one optimizer step.

    The algorithm, exactly (a plain-Python copy of it lives in the tests and
    is compared with this function over random step sequences)::

        if grads_finite:
            consecutive_skips = 0
            hysteresis_left = hysteresis
            good_steps += 1                      # saturating
            if mode == "dynamic" and good_steps >= growth_interval:
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

    In `'static'` mode the scale never changes; in `'none'` mode nothing
    changes at all (no step is ever skipped). The scale stays in
    `[min_scale, max_scale]`, so it is never 0, inf or NaN.

    Args:
        config: A `LossScaleConfig`.
        state: A `LossScaleState` of tensors or variables.
        grads_finite: A scalar bool (tensor): were all gradients finite?

    Returns:
        The next `LossScaleState`, of tensors. Works eagerly and in graphs.
    """
    if config.mode == NONE:
        return state
    finite = tf.convert_to_tensor(grads_finite, tf.bool)
    scale = tf.convert_to_tensor(state.scale, tf.float32)
    good = tf.convert_to_tensor(state.good_steps, tf.int64)
    hyst = tf.convert_to_tensor(state.hysteresis_left, tf.int64)
    skipped = tf.convert_to_tensor(state.skipped_total, tf.int64)
    consecutive = tf.convert_to_tensor(state.consecutive_skips, tf.int64)

    good_after = _saturating_increment(good)
    if config.mode == DYNAMIC:
        grow = tf.logical_and(finite, good_after >= config.growth_interval)
        grown = tf.minimum(scale * config.growth_factor, config.max_scale)
        backoff_now = tf.logical_and(tf.logical_not(finite), hyst <= 1)
        backed_off = tf.maximum(scale * config.backoff_factor, config.min_scale)
        new_scale = tf.where(grow, grown, tf.where(backoff_now, backed_off, scale))
        new_good = tf.where(
            finite,
            tf.where(grow, tf.zeros_like(good), good_after),
            tf.zeros_like(good),
        )
        new_hyst = tf.where(
            finite,
            tf.constant(config.hysteresis, tf.int64),
            tf.where(hyst <= 1, hyst, hyst - 1),
        )
    else:  # static
        new_scale = scale
        new_good = tf.where(finite, good_after, tf.zeros_like(good))
        new_hyst = hyst
    return LossScaleState(
        scale=new_scale,
        good_steps=new_good,
        hysteresis_left=new_hyst,
        skipped_total=tf.where(finite, skipped, _saturating_increment(skipped)),
        consecutive_skips=tf.where(
            finite, tf.zeros_like(consecutive), _saturating_increment(consecutive)
        ),
        last_finite=finite,
    )


def _values(t: Any) -> tf.Tensor:
    return t.values if isinstance(t, tf.IndexedSlices) else t


def finite_flags(tensors: Iterable[Any]) -> tf.Tensor:
    """A bool vector, one entry per tensor: whether all its values are finite.

    `None` (no gradient) counts as finite, so entries line up with variables.
    """
    checks = [
        tf.constant(True) if t is None else tf.reduce_all(tf.math.is_finite(_values(t)))
        for t in tensors
    ]
    if not checks:
        return tf.ones((0,), tf.bool)
    return tf.stack(checks)


def all_finite(tensors: Iterable[Any]) -> tf.Tensor:
    """Returns a scalar bool tensor: True when every value of every tensor is
    finite (no inf, no NaN). `None` entries (no gradient) are ignored.

    Args:
        tensors: Tensors, `tf.IndexedSlices` or `None`s (any flat iterable).

    Example:

    >>> bool(kmp.all_finite([tf.ones(3), None, tf.constant([1.0, 2.0])]))
    True
    >>> bool(kmp.all_finite([tf.constant([1.0, float("inf")])]))
    False
    """
    return tf.reduce_all(finite_flags(tensors))
