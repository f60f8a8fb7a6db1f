"""A run that trains nothing stops, loudly, by default.

kmp skips every step whose gradients are inf/NaN, under every policy. So a
run can go on for epochs while no step is applied, its `loss` flat or NaN.
After each call of the train function from `fit`, kmp reads each
`kmp.LossScaleOptimizer`'s count of steps skipped in a row. When it reaches
`STALLED_AFTER` with nothing left to lower, `fit` raises a
`TrainingCollapsedError` that says why and what to do.

"Nothing left to lower" means the scale is fixed (mode `'static'`), not
used (mode `'none'`: bfloat16, float32), or at its floor (`min_scale`) with
a step skipped there too. A dynamic scale still falling is not stalled:
each skip halves it.

`kmp.callbacks.NonFiniteGuard` checks the same thing, configurably: a
`fit` that has one among its callbacks leaves the check to it.

On JAX, the counters are read once in `QUEUED_AT_MOST` steps, before the
next step is dispatched, so that `fit`'s state stays whole. So the error
can come up to twice that many steps later than on TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from kmp.backend.jax import state as jax_state
from kmp.scaling import registry
from kmp.scaling.optimizer import LossScaleOptimizer

# Skipped steps in a row, with nothing left to lower, before `fit` stops.
# `kmp.callbacks.NonFiniteGuard`'s default too.
STALLED_AFTER = 10

# On JAX, the stall check reads the counters once in this many steps.
QUEUED_AT_MOST = 8


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


class StallCheck:
    """The check kmp's train function runs after each call from `fit` (see
    the module docstring). It keeps, per optimizer, the count of skips in a
    row at which it first saw the scale at its floor: a dynamic scale is
    stalled only once a step at the floor was skipped too."""

    def __init__(self):
        self._floor_seen_at: dict[int, int] = {}
        # On JAX: the counters of the last steps, copied, not yet read.
        self._queued: list[dict] = []

    def __call__(self, model: keras.Model) -> None:
        """Raises `TrainingCollapsedError` where an optimizer kmp reports for
        `model` stalled (on TensorFlow, after each step). Reads one counter
        per optimizer; the scale and the cause only once that count reaches
        `STALLED_AFTER`."""
        self._check(
            model,
            lambda opt: (
                lambda: _number(opt.consecutive_skips),
                lambda: _number(opt.loss_scale),
            ),
        )

    def queue(self, model: keras.Model, state: tuple) -> None:
        """On JAX, after each step: keeps copies of the counters in the
        `state` it returned, for `check_queued`."""
        optimizers = [
            opt
            for opt in registry.optimizers_of(model).values()
            if isinstance(opt, LossScaleOptimizer)
        ]
        values = jax_state.reader(model, state)(
            [
                v
                for opt in optimizers
                for v in (opt.consecutive_skips, opt.dynamic_scale)
            ]
        )
        self._queued.append(
            {
                id(opt): tuple(values[2 * i : 2 * i + 2])
                for i, opt in enumerate(optimizers)
            }
        )

    def check_queued(self, model: keras.Model, loss: Any = None) -> None:
        """On JAX, before each step: once `QUEUED_AT_MOST` steps are queued,
        the check, on the counters of the newest that has run (or else the
        oldest, waiting for it); the others are dropped unread: a stall
        shows in any later count. The host reads once in `QUEUED_AT_MOST`
        steps. The step about to run is not yet dispatched: the state `fit`
        holds is whole, and its `finally` writes it back after the error.
        `loss`: the mean loss in the last step's logs, for the error."""
        if len(self._queued) < QUEUED_AT_MOST:
            return
        done = [
            i
            for i, counters in enumerate(self._queued)
            if jax_state.ready(
                [v for pair in counters.values() for v in pair if v is not None]
            )
        ]
        counters = self._queued[done[-1] if done else 0]
        self._queued.clear()

        def read(opt: LossScaleOptimizer) -> tuple | None:
            values = counters.get(id(opt), (None, None))
            if any(value is None for value in values):
                return None
            skips, scale = values
            return (lambda: skips.item(), lambda: scale.item())

        self._check(model, read, loss)

    def forget(self) -> None:
        """Drops the queued counters (a guard takes the check over)."""
        self._queued.clear()

    def _check(self, model: keras.Model, counters: Callable, loss: Any = None) -> None:
        """Raises for the first optimizer that stalled. `counters(opt)`
        gives functions that read its skips in a row and its scale (None:
        nothing to read)."""
        optimizers = registry.optimizers_of(model)
        for label, opt in optimizers.items():
            if not isinstance(opt, LossScaleOptimizer):
                continue
            readers = counters(opt)
            if readers is None:
                continue
            stalled = self._stalled(opt, *readers)
            if stalled is not None:
                name = label if len(optimizers) > 1 else ""
                raise _error(model, name, opt, *stalled, loss=loss)

    def _stalled(
        self, opt: LossScaleOptimizer, skips: Callable, scale: Callable
    ) -> tuple[int, str] | None:
        """Where `opt` is stalled, its skips in a row and why (the words for
        the message); else None. `skips` and `scale` read its counters."""
        in_a_row = skips()
        if in_a_row < STALLED_AFTER:
            self._floor_seen_at.pop(id(opt), None)
            return None
        if opt.mode == "static":
            return in_a_row, f"with a static loss scale ({opt.config.initial_scale:g})"
        if opt.mode != "dynamic":
            return in_a_row, "without loss scaling (nothing to lower)"
        scale = scale()
        # The scale is a float32: compare with the floor as float32 holds it.
        if scale > np.float32(opt.config.min_scale):
            self._floor_seen_at.pop(id(opt), None)
            return None
        first = self._floor_seen_at.setdefault(id(opt), in_a_row)
        if in_a_row == first:  # no step has run at the floor yet
            return None
        return in_a_row, f"with the loss scale at its floor ({scale:g})"


def loss_finite(opt: LossScaleOptimizer, loss: Any) -> bool | None:
    """Whether `opt`'s loss was finite at its last skipped step; None where
    kmp did not see it. On JAX, where kmp records no loss apart, read from
    `loss`, the epoch's mean loss in a step's logs: finite only where every
    step's loss was (a non-finite one is taken for a forward overflow).
    `kmp.callbacks.NonFiniteGuard` asks the same."""
    if keras.backend.backend() == "jax":
        return None if loss is None else bool(np.isfinite(float(loss)))
    if not opt._loss_recorded:
        return None
    return bool(_number(opt.overflow_record.loss_finite))


def _error(
    model: keras.Model,
    label: str,
    opt: LossScaleOptimizer,
    in_a_row: int,
    why: str,
    loss: Any = None,
) -> TrainingCollapsedError:
    """The error for `opt` (`label`: its name where there are several),
    which skipped `in_a_row` steps in a row (`why`: with what scale).
    `loss`: on JAX, the mean loss in the last step's logs."""
    finite = loss_finite(opt, loss)
    forward = finite is False
    if finite is None:
        cause = (
            "The gradients are inf/NaN. kmp did not see the loss: the "
            "train_step does not call optimizer.scale_loss."
            if keras.backend.backend() != "jax"
            else "The gradients are inf/NaN (the step's logs hold no loss)."
        )
    elif forward:
        cause = (
            "The loss itself is inf/NaN: a layer overflows in the forward "
            "pass, or the data holds inf/NaN."
        )
    else:
        cause = (
            "The loss is finite but the gradients are inf/NaN: they "
            "overflow, or a layer hides inf/NaN inputs from the loss."
        )
    whose = f"optimizer {label!r}" if label else "the optimizer"
    return TrainingCollapsedError(
        f"Training of {model.name!r} stalled: the last {in_a_row} steps of "
        f"{whose} were all skipped, {why}. No weight it trains is changing. "
        f"{cause} Find the layer with kmp.debug.find_nonfinite(model, "
        "x_batch). To have fit name it, pass "
        "kmp.callbacks.NonFiniteGuard(probe=x_batch) in callbacks; "
        "NonFiniteGuard(on_collapse='warn') lets the run go on.",
        "forward" if forward else "gradient",
    )
