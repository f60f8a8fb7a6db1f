"""Which loss-scale optimizers a step applied, for telemetry.

kmp's train function opens `recorded()` around a model's first step, and
warns where that step applied a `kmp.LossScaleOptimizer` whose loss scale
and skipped steps telemetry does not report. The optimizer's one hook is
`applied(self)`, called at each `apply` (traced or eager).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

# The lists `recorded` has open in each thread.
_open = threading.local()


@contextlib.contextmanager
def recorded() -> Iterator[list]:
    """Collects every optimizer whose `apply` runs (traced or eagerly) in
    this thread inside the block, once each. A `tf.distribute` strategy
    that runs its replicas in threads of its own applies there: nothing is
    collected then.

    Yields:
        The list the optimizers are collected in.
    """
    applied: list = []
    stack = _open.__dict__.setdefault("stack", [])
    stack.append(applied)
    try:
        yield applied
    finally:
        # By identity: two lists that hold the same optimizers are equal.
        del stack[next(i for i, a in enumerate(stack) if a is applied)]


def applied(optimizer: Any) -> None:
    """Records that `optimizer` applied a step, in every open `recorded()`
    list of this thread (`kmp.LossScaleOptimizer.apply` calls it)."""
    for collected in getattr(_open, "stack", ()):
        if not any(o is optimizer for o in collected):
            collected.append(optimizer)
