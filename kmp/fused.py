"""The fused optimizer update: a Keras optimizer's `apply` as one XLA program.

Mixed precision keeps float32 master weights, so every step ends with a
float32 update of every weight, and that update does not get faster with
16-bit math. Keras's optimizers write the update as separate elementwise
ops (Adam: about a dozen passes over the weights, the moments and the
gradients); on a CPU those passes are memory-bound, and for a 3 x Dense(2048)
MLP under bfloat16 they were about a quarter of the step (issue #5). Running
the same `apply` under `tf.function(jit_compile=True)` lets XLA fuse the
passes into a few loops over the data: the same formulas, ~3.5x faster here
(benchmarks/RESULTS.md). This is the job NVIDIA Apex's FusedAdam does for
PyTorch AMP, done for any Keras optimizer through TensorFlow's public API.

Only the update is compiled, not the model: XLA's CPU matmuls do not use
the bfloat16 matrix units that oneDNN uses, so compiling the whole step
(`jit_compile=True` in `compile`) is slower under bfloat16.

`kmp.LossScaleOptimizer(fused_update=...)` decides: `None` (the default)
fuses Keras's built-in optimizers (each tested to compute the same numbers
fused) on machines without GPUs or TPUs (where it was measured), outside
tf.distribute strategies (an update that all-reduces across replicas cannot
run inside one XLA program here); `True` and `False` force it, `True` also
for your own optimizer classes.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from kmp import hardware


def default_for_machine() -> bool:
    """Whether `fused_update=None` fuses on this machine: on a machine
    without GPUs or TPUs, where it was measured to help."""
    caps = hardware.capabilities()
    return not caps.gpus and not caps.tpus


def check_setting(value: Any) -> bool | None:
    """Validates a `fused_update` argument (None, True or False)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            "fused_update must be None (fuse where it helps: machines without "
            "GPUs or TPUs), True or False. Received: "
            f"{value!r} (of type {type(value).__name__})."
        )
    return value


def is_builtin(optimizer: Any) -> bool:
    """Whether `optimizer` is one of Keras's own optimizer classes (or the
    name of one), which XLA compiles and which kmp's tests cover."""
    if isinstance(optimizer, str):
        return True  # keras.optimizers.get resolves it to a built-in class
    return type(optimizer).__module__.startswith("keras.")


def resolve(setting: bool | None, optimizer: Any = None) -> bool:
    """Whether an apply with this `fused_update` setting fuses, here and now
    (called when the update is traced, so it sees the strategy in force).
    With `setting=None`, a custom optimizer class is not fused: its update
    may use ops XLA cannot compile."""
    if setting is False:
        return False
    if tf.distribute.has_strategy():
        if setting:
            raise ValueError(
                "fused_update=True cannot be used under a tf.distribute "
                f"strategy ({type(tf.distribute.get_strategy()).__name__}): "
                "the update all-reduces the gradients across replicas, which "
                "cannot run inside one XLA program. Pass fused_update=None "
                "(the default, which does not fuse under a strategy) or False."
            )
        return False
    if setting:
        return True
    return default_for_machine() and (optimizer is None or is_builtin(optimizer))


class FusedApply:
    """Calls `optimizer.apply(grads, variables)` as one XLA program.

    One compiled function per list of variables (a model trains one list;
    a custom loop may train several). The optimizer must be built first:
    XLA programs cannot create variables.
    """

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer
        self._functions: dict[tuple[int, ...] | None, Any] = {}

    def __call__(self, grads: list, variables: list | None) -> None:
        key = None if variables is None else tuple(id(v) for v in variables)
        function = self._functions.get(key)
        if function is None:
            optimizer = self._optimizer

            def update(grads):
                optimizer.apply(grads, variables)

            function = tf.function(update, jit_compile=True, autograph=False)
            self._functions[key] = function
        function(list(grads))
