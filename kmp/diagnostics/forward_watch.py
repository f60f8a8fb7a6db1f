"""`OverflowHealer`'s watch of the forward pass: how the steps traced while
it holds treat a step whose loss itself is inf/NaN.

The watch is the one hook a `kmp.LossScaleOptimizer` offers the healer:
its `_forward_watch` attribute, None unless a watch holds. The optimizer
consults it in two places. When it records a step's loss, it calls
`saw(loss, finite, in_scale_loss)`. When it moves the scale, it reads
`keeps_scale`.

A watch holds for one call of the train function at a time: the healer
renews it before each call (`renew`). kmp's train function calls
`lapsed()` before each call, which ends a watch that was not renewed: the
`fit` that set it was interrupted, or a callback raised. A later `fit`
then trains as it would without it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import keras

from kmp.backend import graph


class ForwardWatch:
    """How the steps of `optimizer` traced from now on treat the forward
    pass. Set it with `watch`.

    Args:
        optimizer: The `kmp.LossScaleOptimizer` it is set on.
        probe: Called with the loss when `scale_loss` is traced, in the
            step's graph (the forward pass's ops are there), or None.
        keeps_scale: Whether a step whose loss itself is inf/NaN leaves the
            loss scale as it is: a lower scale cannot fix a forward
            overflow. The step is skipped and counted either way.
        counter: An int64 variable to which each step whose loss is
            inf/NaN adds one, or None. A call of the train function may run
            several steps (`steps_per_execution`).
    """

    def __init__(
        self,
        optimizer: Any,
        probe: Callable[[Any], None] | None,
        keeps_scale: bool,
        counter: Any,
    ):
        self._optimizer = weakref.ref(optimizer)
        self.probe = probe
        self.keeps_scale = bool(keeps_scale)
        self.counter = counter
        self._lease = True

    def saw(self, loss: Any, finite: Any, in_scale_loss: bool) -> None:
        """Called by the optimizer with each step's loss (before scaling)
        and whether it is finite, agreed on across replicas."""
        if self.counter is not None:
            nonfinite = keras.ops.logical_not(finite)
            self.counter.assign_add(keras.ops.cast(nonfinite, self.counter.dtype))
        if in_scale_loss and self.probe is not None and graph.building():
            self.probe(loss)

    def renew(self) -> None:
        """Has the watch hold for the next call of the train function too."""
        self._lease = True

    def lapsed(self) -> bool:
        """Takes the lease for this call of the train function (which calls
        it before each). Where it was not renewed since the last call, ends
        the watch and returns True: the step must be traced again."""
        if self._lease:
            self._lease = False
            return False
        optimizer = self._optimizer()
        if optimizer is not None and optimizer._forward_watch is self:
            optimizer._forward_watch = None
        return True


def watch(
    optimizer: Any,
    probe: Callable[[Any], None] | None = None,
    keeps_scale: bool = False,
    counter: Any = None,
) -> None:
    """Sets `optimizer`'s watch (a `kmp.LossScaleOptimizer`'s), or ends it
    where nothing is watched. The step must be traced again to see it."""
    watched = probe is not None or keeps_scale or counter is not None
    optimizer._forward_watch = (
        ForwardWatch(optimizer, probe, keeps_scale, counter) if watched else None
    )


def end(optimizer: Any) -> None:
    """Ends `optimizer`'s watch, if any. The step must be traced again."""
    optimizer._forward_watch = None


def renew(optimizer: Any) -> None:
    """Has `optimizer`'s watch, if any, hold for the next call too."""
    if optimizer._forward_watch is not None:
        optimizer._forward_watch.renew()
