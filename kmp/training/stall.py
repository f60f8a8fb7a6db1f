"""A run that trains nothing stops, loudly, by default.

kmp skips every step whose gradients are inf/NaN, under every policy. So a
run can go on for epochs while no step is applied, its `loss` flat or NaN.
After each call of the train function from `fit`, kmp reads each
`kmp.LossScaleOptimizer`'s count of steps skipped in a row. When it reaches
`STALLED_AFTER` with nothing left to lower, `fit` raises a
`TrainingCollapsedError` that says why and what to do.

"Nothing left to lower" means the scale is at its floor (`min_scale`), fixed
(mode `'static'`), or not used (mode `'none'`: bfloat16, float32). A dynamic
scale still falling is not stalled: each skip halves it.

`kmp.callbacks.NonFiniteGuard` checks the same thing, configurably: a
`fit` that has one among its callbacks leaves the check to it.
"""

from __future__ import annotations

from typing import Any

import keras

from kmp.scaling import registry
from kmp.scaling.optimizer import LossScaleOptimizer

# Skipped steps in a row, with nothing left to lower, before `fit` stops.
# `kmp.callbacks.NonFiniteGuard`'s default too.
STALLED_AFTER = 10


class TrainingCollapsedError(RuntimeError):
    """Training stalled: steps keep being skipped and the loss scale has
    nothing left to lower. `cause` is `'forward'` (the loss itself is
    inf/NaN), `'gradient'` (the loss is finite, the gradients are not) or
    `'weights'` (an optimizer applied a non-finite step); `layers` names the
    layers involved where they are known; `report` is the message."""

    def __init__(self, report: str, cause: str, layers: tuple[str, ...] = ()):
        super().__init__(report)
        self.report = report
        self.cause = cause
        self.layers = layers


def _number(variable: Any) -> Any:
    """A scalar variable's value, as a Python number."""
    return variable.numpy().item()


def check(model: keras.Model) -> None:
    """Raises `TrainingCollapsedError` where one of the optimizers kmp
    reports for `model` skipped its last `STALLED_AFTER` steps with nothing
    left to lower (see the module docstring). Reads one counter per
    optimizer; the scale and the cause only when that count is reached."""
    optimizers = registry.optimizers_of(model)
    for label, opt in optimizers.items():
        if not isinstance(opt, LossScaleOptimizer):
            continue
        in_a_row = _number(opt.consecutive_skips)
        if in_a_row < STALLED_AFTER:
            continue
        if opt.mode == "dynamic":
            scale = _number(opt.loss_scale)
            if scale > opt.config.min_scale:
                continue
            why = f"with the loss scale at its floor ({scale:g})"
        elif opt.mode == "static":
            why = f"with a static loss scale ({opt.config.initial_scale:g})"
        else:
            why = "without loss scaling (nothing to lower)"
        forward = not _number(opt.overflow_loss_finite)
        cause = (
            "The loss itself is inf/NaN: a layer overflows in the forward "
            "pass, or the data holds inf/NaN."
            if forward
            else "The loss is finite but the gradients are inf/NaN: they "
            "overflow, or a layer hides inf/NaN inputs from the loss."
        )
        which = f" ({label})" if len(optimizers) > 1 else ""
        raise TrainingCollapsedError(
            f"Training of {model.name!r} stalled: the last {in_a_row} steps in "
            f"a row were skipped{which}, {why}. No weight is changing. "
            f"{cause} Find the layer with kmp.debug.find_nonfinite(model, "
            "x_batch). To have fit name it, pass "
            "kmp.callbacks.NonFiniteGuard(probe=x_batch) in callbacks; "
            "NonFiniteGuard(on_collapse='warn') lets the run go on.",
            "forward" if forward else "gradient",
        )
