"""A check that the replicas of a `tf.distribute` strategy agree on the loss
scale: `kmp.debug.verify_replicas`, on demand."""

from __future__ import annotations

from typing import Any

from kmp._base import backends
from kmp.backend import distribute
from kmp.scaling import loss_scale as ls


class ReplicaDivergenceError(RuntimeError):
    """Replicas hold different loss-scale states."""


def verify_replicas(optimizer: Any) -> int:
    """Checks that every replica holds the same loss scale, counters and last
    decision; raises `ReplicaDivergenceError` naming what differs.

    Args:
        optimizer: A `kmp.LossScaleOptimizer`, used inside or outside a
            strategy.

    Returns:
        The number of replica copies compared (1 outside a strategy).

    Raises:
        ReplicaDivergenceError: where the replicas disagree.
        NotImplementedError: on a Keras backend other than TensorFlow.

    Example:

    >>> opt = kmp.LossScaleOptimizer("sgd", mode="dynamic")
    >>> kmp.debug.verify_replicas(opt)
    1
    """
    backends.require_tensorflow(
        "kmp.debug.verify_replicas, a check of tf.distribute's replicas,",
        "On JAX the loss-scale state is one array for every device, and the "
        "finite check reads the whole sharded gradients: there are no "
        "replicas to compare.",
    )
    if not isinstance(getattr(optimizer, "_scale", None), ls.LossScale):
        raise TypeError(
            "verify_replicas() expects a kmp.LossScaleOptimizer. Received: "
            f"{optimizer!r} (of type {type(optimizer).__name__})."
        )
    state = optimizer._scale.state
    copies = 1
    differing = []
    for field, name in ls.PUBLIC_NAMES.items():
        local = distribute.local_values(getattr(state, field))
        copies = max(copies, len(local))
        if len(set(local)) > 1:
            differing.append(f"{name}: {local}")
    if differing:
        raise ReplicaDivergenceError(
            "Replicas disagree on the loss-scale state: "
            + "; ".join(differing)
            + ". Every replica must make the same skip decision. This is a bug "
            "in kmp or a variable created outside strategy.scope(): create the "
            "optimizer (and compile the model) inside the scope."
        )
    return copies
