"""The fused optimizer update: a Keras optimizer's `apply` as one XLA program.

Mixed precision keeps float32 master weights, so every step ends with a
float32 update of every weight, and that update does not get faster with
16-bit math. Keras's optimizers write the update as separate elementwise
ops (Adam: about a dozen passes over the weights, the moments and the
gradients); on a CPU those passes are memory-bound, and for a 3 x Dense(2048)
MLP under bfloat16 they were about a quarter of the step (issue #5). Running
the same `apply` under `tf.function(jit_compile=True)` lets XLA fuse the
passes into a few loops over the data: the same formulas, 3x faster here for
Adam (benchmarks/RESULTS.md). This is the job NVIDIA Apex's FusedAdam does
for PyTorch AMP, done for Keras optimizers through TensorFlow's public API.

Only the update is compiled, not the model: compiling the whole bfloat16
step with XLA (`jit_compile=True`) loses oneDNN's bfloat16 matmuls: it ran
1.7x slower than fusing only the update here (benchmarks/RESULTS.md).
That is also why kmp fuses by default only on machines without GPUs or
TPUs: on a GPU machine Keras's `jit_compile="auto"` (the default) compiles
the whole training step with XLA, update included, when every layer
supports it, while on a CPU-only machine it turns XLA off.

`kmp.LossScaleOptimizer(fused_update=...)` decides, under any policy:
`None` (the default) fuses the Keras optimizers in `TESTED` (each tested to
compute the same numbers fused; not their subclasses) on machines without
GPUs or TPUs (where it was measured), outside tf.distribute strategies (an
update that all-reduces across replicas cannot run inside one XLA program
here) and unless op determinism is enabled (as Keras, which then keeps XLA
off); `True` and `False` force it, `True` also for other optimizer classes.
`kmp.compile` wraps every optimizer (to skip non-finite steps), but its
default fuses only under 16-bit policies; float32 models are fused when
asked for.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from kmp import hardware

# The optimizer classes `fused_update=None` fuses (tests/test_fused.py checks
# each against its unfused update). Not Muon (its update is mostly matmuls,
# not elementwise passes; not measured) nor MultiOptimizer (its parts may be
# any class).
TESTED = tuple(
    getattr(keras.optimizers, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
        "Adadelta", "Adafactor", "Ftrl", "Lamb", "Lion",
    )
)  # fmt: skip


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


def _op_determinism_enabled() -> bool:
    # TensorFlow has no public getter; Keras reads the same function.
    try:
        from tensorflow.python.framework import config
    except ImportError:  # pragma: no cover - a TensorFlow without it
        return False
    return bool(config.is_op_determinism_enabled())


def is_tested(optimizer: Any) -> bool:
    """Whether `optimizer` (or the optimizer a name such as `'adam'` stands
    for) is of a class in `TESTED` (exactly: not a subclass).

    Example:

    >>> kmp.fused.is_tested("adam")
    True
    >>> class MyAdam(keras.optimizers.Adam):
    ...     pass
    >>> kmp.fused.is_tested(MyAdam())
    False
    """
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    return type(optimizer) in TESTED


def resolve(setting: bool | None, optimizer: Any = None) -> bool:
    """Whether an apply with this `fused_update` setting fuses, here and now
    (called when the update is traced, so it sees the strategy in force).
    With `setting=None`, only the classes in `TESTED` are fused.

    Example:

    >>> kmp.fused.resolve(True), kmp.fused.resolve(False)  # no strategy here
    (True, False)
    >>> kmp.fused.resolve(None) == kmp.fused.default_for_machine()
    True
    """
    if setting is False:
        return False
    if tf.distribute.has_strategy():
        if setting:
            raise ValueError(
                "fused_update=True cannot be used under a tf.distribute "
                f"strategy ({type(tf.distribute.get_strategy()).__name__}): "
                "the update all-reduces the gradients across replicas, which "
                "cannot run inside one XLA program. Pass fused_update=None "
                "(the default, which does not fuse under a strategy) or False; "
                "for a loaded model, set model.optimizer.fused_update = None "
                "before training, or load it with compile=False and compile "
                "it again."
            )
        return False
    if setting:
        return True
    return (
        default_for_machine()
        and not _op_determinism_enabled()
        and (optimizer is None or is_tested(optimizer))
    )


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

            # The closure keeps `variables` alive, so their ids stay theirs.
            function = tf.function(update, jit_compile=True, reduce_retracing=True)
            self._functions[key] = function
        function(list(grads))
