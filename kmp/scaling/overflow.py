"""The overflow record: which variables had inf/NaN gradients at the last
skipped step, and whether the loss itself was finite then.

`kmp.LossScaleOptimizer` keeps one (`optimizer.overflow_record`) and writes
it in the same pass as its finite check, so the record costs no extra
reduction; `kmp.debug.last_overflow` and `kmp.callbacks` read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras


class OverflowRecord:
    """Per trainable variable, whether its gradient was finite at the last
    skipped step (in build order), and the loss's finiteness.

    Args:
        make_variable: Creates a state variable: called as
            `make_variable(name, dtype, initial_value, shape)`.

    Attributes:
        last_loss_finite: Whether the last loss (before scaling) was finite.
        loss_finite: Whether the loss was finite at the last skipped step
            (False: that step's overflow was in the forward pass).
    """

    def __init__(self, make_variable: Callable):
        self._make = make_variable
        self.last_loss_finite = make_variable("last_loss_finite", "bool", True, ())
        self.loss_finite = make_variable("overflow_loss_finite", "bool", True, ())
        self._flags = None
        self._variables: tuple = ()
        self._index: dict[int, int] = {}

    def build(self, variables: list) -> None:
        """Creates the per-variable flags for `variables` (the optimizer's)."""
        self._flags = self._make("overflow_flags", "bool", True, (len(variables),))
        self._variables = tuple(variables)
        self._index = {id(v): i for i, v in enumerate(variables)}

    @property
    def built(self) -> bool:
        return self._flags is not None

    @property
    def flags(self) -> keras.Variable:
        """The flags variable: False where the last skipped step's gradient
        held inf/NaN."""
        if self._flags is None:
            raise ValueError(
                "The overflow record is not available yet: it is created when "
                "the optimizer is built, which it is not. Train a step first, or "
                "call optimizer.build(model.trainable_variables)."
            )
        return self._flags

    @property
    def variables(self) -> tuple:
        """The variables the flags refer to, in order."""
        return self._variables

    def record_loss(self, finite: Any) -> None:
        self.last_loss_finite.assign(finite)

    def by_variable(self, flags: Any, variables: list):
        """Places per-gradient flags at their variables' build positions."""
        unknown = [v for v in variables if id(v) not in self._index]
        if unknown:
            raise ValueError(
                "apply() received variables the optimizer was not built with: "
                f"{', '.join(getattr(v, 'path', str(v)) for v in unknown)}. "
                "Expected a subset of the variables passed to build() (or to the "
                "first apply()). Use one optimizer per set of variables."
            )
        positions = [self._index[id(v)] for v in variables]
        if positions == list(range(len(self._variables))):
            return flags
        return keras.ops.scatter_update(
            keras.ops.ones((len(self._variables),), "bool"),
            [[p] for p in positions],
            flags,
        )

    def record(self, by_variable: Any) -> None:
        """Keeps the flags of a step that is being skipped (called only then,
        so that finite steps pay nothing for the record)."""
        self.flags.assign(by_variable)
        self.loss_finite.assign(keras.ops.convert_to_tensor(self.last_loss_finite))
