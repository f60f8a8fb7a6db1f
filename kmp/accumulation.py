"""Gradient accumulation under loss scaling: an overflow anywhere in a window
of micro-batches skips the whole window.

Keras's own accumulation (`gradient_accumulation_steps` on an optimizer)
cannot discard a window. `kmp.LossScaleOptimizer` takes it over from its
inner optimizer: it sums the unscaled micro-batch gradients here, and hands
the inner optimizer one mean gradient per window, only if every micro-batch
of the window was finite; the loss scale then moves once per window, so
growth intervals and skip counters count optimizer steps. Like Optax's
`MultiSteps`, with `apply_if_finite` over the whole window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf


class Accumulation:
    """The accumulation window of one optimizer.

    Args:
        steps: Micro-batches per window.

    Attributes:
        micro_step: Micro-batches seen so far (a variable, after `build`).
        window_finite: Whether every micro-batch of the open window was
            finite (a variable, after `build`).
    """

    def __init__(self, steps: int):
        self.steps = int(steps)
        self.micro_step = None
        self.window_finite = None
        self._sums: list = []
        self._index: dict[int, int] = {}
        # Eagerly, a micro-batch may leave a variable without a gradient that
        # an earlier one gave it: ids of the variables with one in the window.
        self._seen: set[int] = set()

    def build(self, variables: list, make_variable: Callable, like: Callable) -> None:
        """Creates the window's state: a sum per variable (`like(v, name)`),
        the micro-step counter and the window's finiteness."""
        self.micro_step = make_variable("micro_step", "int64", 0, ())
        self.window_finite = make_variable("window_finite", "bool", True, ())
        self._sums = [like(v, "gradient_accumulator") for v in variables]
        self._index = {id(v): i for i, v in enumerate(variables)}

    @property
    def sums(self) -> list:
        """The running sums of the open window, one per variable."""
        return list(self._sums)

    def add(
        self,
        grads: list,
        variables: list,
        finite: Any,
        close: Callable[[list, Any], Any],
    ):
        """Adds one micro-batch; at the window's last one, calls
        `close(mean_grads, window_finite)` (which applies and adjusts) and
        returns what it returns; else returns False (no step applied)."""
        ops = keras.ops
        sums = [self._sums[self._index[id(v)]] for v in variables]
        eager = tf.executing_eagerly()  # a traced step has one None pattern
        for total, g, v in zip(sums, grads, variables, strict=True):
            if g is not None:
                g = ops.convert_to_tensor(g)
                total.assign_add(ops.where(finite, g, ops.zeros_like(g)))
                if eager:
                    self._seen.add(id(v))
        window_finite = ops.logical_and(
            ops.convert_to_tensor(self.window_finite), finite
        )
        micro_step = self.micro_step + 1
        self.micro_step.assign(micro_step)

        def close_window():
            mean = [
                total / self.steps if g is not None or id(v) in self._seen else None
                for total, g, v in zip(sums, grads, variables, strict=True)
            ]
            applied = close(mean, window_finite)
            for total in sums:
                total.assign(ops.zeros_like(total))
            self._seen.clear()
            self.window_finite.assign(True)
            return applied

        def continue_window():
            self.window_finite.assign(window_finite)
            return ops.convert_to_tensor(False)

        return ops.cond(micro_step % self.steps == 0, close_window, continue_window)
