"""A step applied only where its gradients are finite, on JAX.

On TensorFlow, a condition may assign variables in its branches
(`kmp.backend.distribute.step_if_finite`). A JAX condition may not: its
branches are pure functions. Here each branch runs its assignments in a
`keras.StatelessScope` of its own and returns the new values; the values
the taken branch returns are then assigned, outside the condition. That is
how Keras's own `LossScaleOptimizer.stateless_apply` skips a step, written
once for any update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras


def _pure(fn: Callable[[], Any], variables: list, values: list) -> Callable[[], list]:
    """`fn`, which assigns `variables`, as a function that returns their
    values after it (starting from `values`) and assigns nothing."""

    def run() -> list:
        with keras.StatelessScope(
            state_mapping=list(zip(variables, values, strict=True))
        ) as scope:
            fn()
        return [scope.get_current_value(v) for v in variables]

    return run


def step_if_finite(
    finite: Any,
    apply: Callable,
    grads: list,
    variables: list,
    after: Callable[[Any], None],
    on_skip: Callable[[Any], None] | None = None,
    record: Any = None,
    *,
    state: list,
):
    """Calls `apply(grads, variables)` only if `finite`, else
    `on_skip(record)`; then `after(finite)`; returns `finite` (as
    `kmp.backend.distribute.step_if_finite` does on TensorFlow).

    `state` lists the variables either branch may assign besides
    `variables` (the optimizer's). Their values are read once, before the
    condition; inside `stateless_apply` they are those of its state.
    Under `jit`, JAX runs only the branch taken, as Keras's wrapper does.
    """
    written = list({id(v): v for v in [*variables, *state]}.values())
    values = [v.value for v in written]

    def skip() -> None:
        if on_skip is not None:
            on_skip(record)

    new = keras.ops.cond(
        finite,
        _pure(lambda: apply(grads, variables), written, values),
        _pure(skip, written, values),
    )
    for variable, value in zip(written, new, strict=True):
        variable.assign(value)
    after(finite)
    return finite
