"""The loss scale: its settings, its state machine, and the object that
scales, unscales and adjusts.

`next_state(config, state, grads_finite)` is the one transition function, and
`LossScale` the one object that holds a scale: `scale(loss)`, `unscale(grads)`
and `adjust(finite)`. The optimizer (inside `fit`), the scaled gradient tape,
distributed training and `kmp.debug` all go through it; nothing else changes
or applies a loss scale. Both are written with `keras.ops`; only the sparse
gradients of `finite_flags` use TensorFlow's own ops.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

DYNAMIC = "dynamic"
STATIC = "static"
NONE = "none"
MODES = (DYNAMIC, STATIC, NONE)

# Counters are int64 and saturate here instead of wrapping.
COUNTER_MAX = 2**63 - 1


class LossScaleError(ValueError):
    """A loss-scale setting is invalid, or gradients were handed over against
    the optimizer's contract."""

    # Exception's own constructor: TensorFlow's autograph then re-raises this
    # type when it is raised while a tf.function is traced (instead of its
    # StagingError), so the error keeps its type for `except` clauses.
    __init__ = Exception.__init__


def _as_number(value: Any, kinds: str) -> float | int | None:
    """A real number (Python, numpy or a TensorFlow/Keras scalar) as Python's,
    or None. `kinds` are the numpy dtype kinds accepted ('iuf', 'iu')."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if "f" in kinds else None
    if getattr(value, "shape", None) == () or getattr(value, "ndim", None) == 0:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            return None
        if array.shape == () and array.dtype.kind in kinds:
            return array.item()
    return None


def _check_positive_finite(name: str, value: Any) -> float:
    number = _as_number(value, "iuf")
    if number is None:
        raise LossScaleError(
            f"{name} must be a positive finite number (a Python, numpy or "
            f"TensorFlow scalar). Received: {name}={value!r} (of type "
            f"{type(value).__name__})."
        )
    value = float(number)
    if not math.isfinite(value) or value <= 0:
        raise LossScaleError(
            f"{name} must be a positive finite number. Received: {name}={value}. "
            f"Use, for example, {name}=2.0**15."
        )
    return value


def _check_count(name: str, value: Any) -> int:
    number = _as_number(value, "iu")
    if number is None or number < 1:
        raise LossScaleError(
            f"{name} must be an integer >= 1. Received: {name}={value!r}. "
            f"Use, for example, {name}=2000 for growth_interval or 1 for hysteresis."
        )
    return int(number)


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


def _saturating_increment(counter):
    return keras.ops.where(counter < COUNTER_MAX, counter + 1, counter)


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

    In `'static'` mode the scale never changes; in `'none'` mode (no loss
    scaling) the scale stays 1 and the counters count skipped steps as in
    `'static'`: a non-finite step is skipped under every mode. The scale
    stays in `[min_scale, max_scale]`, so it is never 0, inf or NaN. The
    scale is a float32: `scale * growth_factor` is rounded to float32.

    Args:
        config: A `LossScaleConfig`.
        state: A `LossScaleState` of tensors or variables.
        grads_finite: A scalar bool (tensor): were all gradients finite?

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
        grow = ops.logical_and(finite, good_after >= config.growth_interval)
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


def _finite(x: Any):
    """A scalar bool: whether every value of `x` is finite (see finite_flags)."""
    ops = keras.ops
    if keras.backend.standardize_dtype(x.dtype) in ("float32", "float64"):
        return ops.isfinite(ops.sum(x))
    return ops.all(ops.isfinite(x))


def _values(t: Any):
    """The values to check of a gradient. For a 16-bit sparse gradient
    (IndexedSlices, e.g. an Embedding's), the rows summed per index, as the
    update sums them: each value may be finite while a repeated token's sum
    overflows. A float32/64 sparse gradient's rows as they are: `_finite`
    checks them through their total, one pass instead of finding the unique
    indices; any inf/NaN row makes it non-finite, and the only per-index
    overflow it can miss needs values near float32's limit (~1e38) that
    cancel across indices."""
    if isinstance(t, tf.IndexedSlices):
        if t.values.dtype in (tf.float32, tf.float64):
            return t.values
        unique, position = tf.unique(t.indices)
        return tf.math.unsorted_segment_sum(t.values, position, tf.shape(unique)[0])
    return t


def finite_flags(tensors: Iterable[Any]):
    """A bool vector, one entry per tensor: whether all its values are finite.

    `None` (no gradient) counts as finite, so entries line up with variables.
    A sparse gradient counts as finite when its rows summed per index are
    (16-bit rows are summed per index; float32 rows through one sum, below).

    A float32 or float64 tensor is checked through its sum, which is
    non-finite when any value is (inf and NaN propagate through addition):
    one pass over the values instead of two, about 3x faster on a CPU. A
    tensor whose values are finite but whose sum overflows (magnitudes
    near 1e38 in float32) counts as non-finite too: its step would not be
    meaningful. 16-bit tensors, whose sums overflow easily, are checked
    value by value.
    """
    ops = keras.ops
    checks = [
        ops.convert_to_tensor(True) if t is None else _finite(_values(t))
        for t in tensors
    ]
    if not checks:
        return ops.ones((0,), "bool")
    return ops.stack(checks)


def all_finite(tensors: Iterable[Any]):
    """Returns a scalar bool tensor: True when every value of every tensor is
    finite (no inf, no NaN). `None` entries (no gradient) are ignored; a
    sparse gradient is checked as it will be applied (rows summed per index).

    Args:
        tensors: Tensors, `tf.IndexedSlices` or `None`s (any flat iterable).

    Example:

    >>> bool(kmp.all_finite([tf.ones(3), None, tf.constant([1.0, 2.0])]))
    True
    >>> bool(kmp.all_finite([tf.constant([1.0, float("inf")])]))
    False
    """
    return keras.ops.all(finite_flags(tensors))


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

    >>> scale = kmp.loss_scale.LossScale(
    ...     kmp.LossScaleConfig(initial_scale=8.0),
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
                "LossScale expects a kmp.LossScaleConfig. Received: "
                f"{config!r} (of type {type(config).__name__})."
            )
        self.config = config
        values = LossScaleState.initial_values(config)
        self.state = LossScaleState(
            *(
                make_variable(PUBLIC_NAMES[field], dtype.name, value)
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
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(times(g.values), g.indices, g.dense_shape))
            else:
                out.append(times(g))
        return out

    def adjust(self, finite) -> None:
        """Moves the state after one optimizer step whose gradients were
        (`finite=True`) or were not all finite. Only the fields the mode can
        change are written (in mode `'none'`: the three skip counters)."""
        new = next_state(self.config, self.state, finite)
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


def check_loss(loss, mode: str) -> bool:
    """Refuses a loss that cannot be scaled (not floating point); True for a
    16-bit one while scaling, of which the caller warns
    (`SIXTEEN_BIT_LOSS`)."""
    dtype = getattr(loss, "dtype", None)
    if dtype is None:
        return False
    dtype = tf.as_dtype(dtype)
    if not dtype.is_floating:
        raise TypeError(
            f"The loss must be a floating-point tensor to be scaled. Received a "
            f"loss of dtype {dtype.name}. Cast it first: tf.cast(loss, 'float32')."
        )
    return mode != NONE and dtype.size < 4
