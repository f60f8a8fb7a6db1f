"""Loss-scale settings: the modes, `LossScaleConfig` and its checks,
`kmp.LossScaleError`, and the check of what else a `kmp.LossScaleOptimizer`
is given (`checked_inner`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import keras
import numpy as np

DYNAMIC = "dynamic"


STATIC = "static"


NONE = "none"


MODES = (DYNAMIC, STATIC, NONE)

# Settings a loss-scale optimizer refuses: they act on the inner one's
# (unscaled) gradients.
_INNER_ONLY_ARGS = (
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "weight_decay",
    "use_ema",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


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
            "Use, for example, dynamic_growth_steps=2000 or hysteresis=1."
        )
    return int(number)


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """How the loss scale moves. Immutable; validated on construction.

    Args:
        initial_scale: The scale to start from (the fixed scale in static mode).
        growth_factor: Multiplies the scale after `dynamic_growth_steps` finite
            steps in a row; in (1, inf).
        backoff_factor: Multiplies the scale on an overflow; in (0, 1).
        dynamic_growth_steps: Finite steps in a row before the scale grows.
        min_scale: The floor; the scale never goes below it.
        max_scale: The ceiling; the scale never goes above it.
        hysteresis: Back off on the N-th consecutive overflow (1 = at once;
            after that, on every further consecutive overflow), as DeepSpeed
            does. A finite step resets it.
        mode: `'dynamic'` (the scale adapts), `'static'` (fixed at
            `initial_scale`; non-finite steps are still skipped) or `'none'`
            (no scaling and no skipping: for bfloat16 and float32).

    Example:

    >>> from kmp.scaling.config import LossScaleConfig
    >>> config = LossScaleConfig(initial_scale=2.0**10, dynamic_growth_steps=100)
    >>> config.backoff_factor
    0.5
    """

    initial_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    dynamic_growth_steps: int = 2000
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
        for name in ("dynamic_growth_steps", "hysteresis"):
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
        if self.max_scale > float(np.finfo(np.float32).max) / self.growth_factor:
            raise LossScaleError(
                f"max_scale={self.max_scale} is too large: the scale is a float32 "
                "and growing it would overflow. Use max_scale <= 2.0**64."
            )

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaleConfig:
        return cls(**config)


def checked_inner(inner_optimizer: Any, kwargs: dict) -> Any:
    """The inner optimizer of a `kmp.LossScaleOptimizer`, once the other
    arguments it was given (`kwargs`) are checked: settings that belong on
    the inner optimizer are refused, with the fix."""
    bad = [
        k for k in kwargs if k in _INNER_ONLY_ARGS and kwargs[k] not in (None, False)
    ]
    if bad:
        raise ValueError(
            f"LossScaleOptimizer does not take {', '.join(bad)}: it would act "
            "on scaled gradients. Set it on the inner optimizer instead, "
            f"e.g. keras.optimizers.Adam({bad[0]}=...), which kmp feeds "
            "unscaled gradients."
        )
    if "growth_interval" in kwargs:
        value = kwargs["growth_interval"]
        raise TypeError(
            "LossScaleOptimizer takes the finite steps before the scale grows "
            "as dynamic_growth_steps, Keras's name for it. Received: "
            f"growth_interval={value!r}. Write dynamic_growth_steps={value!r}."
        )
    unknown = [k for k in kwargs if k not in _INNER_ONLY_ARGS]
    if unknown:
        raise TypeError(
            f"LossScaleOptimizer got unexpected arguments: {', '.join(unknown)}. "
            "It takes inner_optimizer, initial_scale, dynamic_growth_steps, "
            "growth_factor, backoff_factor, min_scale, max_scale, hysteresis, "
            "mode, fused_update and name; "
            "optimizer settings belong on the inner optimizer."
        )
    if isinstance(inner_optimizer, str):
        inner_optimizer = keras.optimizers.get(inner_optimizer)
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"inner_optimizer is already a loss-scale optimizer "
            f"({type(inner_optimizer).__name__}); wrapping it again would "
            "scale the loss twice. Pass its inner optimizer instead: "
            "kmp.LossScaleOptimizer(opt.inner_optimizer)."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "inner_optimizer must be a keras.optimizers.Optimizer (such as "
            "keras.optimizers.Adam()) or an optimizer name such as 'adam'. "
            f"Received: {inner_optimizer!r} (of type "
            f"{type(inner_optimizer).__name__})."
        )
    return inner_optimizer
