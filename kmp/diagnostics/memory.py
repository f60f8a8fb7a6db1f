"""A pre-flight estimate of the memory training holds, before training.

What a training step holds at its peak, in tensors (the peak of
TensorFlow's live tensors: the memory above the runtime's own, the GPU's
memory on a GPU): the weights, the optimizer's state, and the step's own
tensors (gradients, what the forward pass saves for the backward pass,
temporaries). The first two are counted from the variables (the
optimizer's by building a copy of it on stand-ins of the model's trainable
variables that hold no memory: exact for any optimizer class). The step's
own grow with the batch, by an amount per sample no formula gives for every
layer (what a layer saves for its gradient depends on its kernels), so they
are measured: forward and backward passes at two small batch sizes (the
median of three at each), in a `tf.function` as `fit` runs its step; their
difference gives the memory per sample, and the rest is what does not grow
with the batch (the gradients among it).
On a CPU, TensorFlow's allocator (oneDNN's) does not count requests under
256 KiB: the measurement leaves out the step's smaller tensors, all of them
in a small model. The step is then counted as at least its gradients (the
tensors it returns), and the estimate says what it could not see
(`MemoryEstimate.uncounted_below_mb`).
Input data are not counted: where they live depends on the input pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras

from kmp._base import backends
from kmp._base import warn as _warn
from kmp.backend import graph
from kmp.backend import live_tensors
from kmp.internals import keras_private

MIB = 2**20
# The two batch sizes the step is measured at.
PROBE_BATCHES = (4, 16)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The tensors a training step of a model holds at its peak, in MiB.

    `total_mb(batch)` is the estimate at a batch size: weights, optimizer
    state, the step's fixed part, and `per_sample_mb` per sample.

    Where `uncounted_below_mb` is above 0 (on a CPU: 0.25, TensorFlow's
    allocator counts no tensor under 256 KiB there), `step_mb` and
    `per_sample_mb` leave out the step's tensors smaller than that: they are
    lower bounds (each measured peak is at least the gradients the step
    returns).
    """

    weights_mb: float  # every variable of the model, as stored
    optimizer_mb: float  # the optimizer's variables, built for the model
    optimizer: str  # the optimizer's class (Adam where none was given)
    gradients_mb: float  # one gradient per trainable variable (in step_mb)
    step_mb: float  # the step's tensors that do not grow with the batch
    per_sample_mb: float  # and those that do, per sample
    uncounted_below_mb: float = 0.0  # tensors under this were not measured

    def total_mb(self, batch_size: int) -> float:
        """The estimated peak of live tensors at `batch_size`."""
        return (
            self.weights_mb + self.optimizer_mb + self.step_mb
            + self.per_sample_mb * batch_size
        )  # fmt: skip

    def largest_batch(self, budget_mb: float) -> int | None:
        """The largest batch size whose estimate is within `budget_mb`: 0
        where even the batch-independent part is not, None where the step
        was not measured to grow with the batch (no bound)."""
        room = budget_mb - self.total_mb(0)
        if room < 0:
            return 0
        if self.per_sample_mb <= 0:
            return None
        return int(room // self.per_sample_mb)


def _optimizer_bytes(model: keras.Model, optimizer: Any) -> tuple[int, str]:
    """The bytes of the optimizer's variables for `model`'s trainable
    variables: a copy of `optimizer` (or of `model.optimizer`, or of Adam
    where the model has none), built and dropped.

    The copy is built on stand-ins of the trainable variables made in a
    graph of its own (same shapes, dtypes and paths), where a variable is a
    node and holds no memory: counting Adam's state for a model that fills
    a GPU must not allocate that state a second time. An optimizer that
    cannot be built there (a class of one's own that reads its variables'
    values as it builds) is built on the variables themselves, with a
    warning."""
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if optimizer is None:
        optimizer, name = keras.optimizers.Adam(), "Adam (the model has no optimizer)"
    else:
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        name = type(inner).__name__

    def copy(config):
        # A config of its own each time: from_config may consume the one it
        # is given (Keras's LossScaleOptimizer takes its inner optimizer out).
        return optimizer.__class__.from_config(config)

    try:
        config = optimizer.get_config()  # eagerly: it reads variables' values
        with graph.detached(), keras_private.name_scopes_restored():
            counted = copy(config)
            counted.build(_stand_ins(model.trainable_variables))
            return live_tensors.nbytes(counted.variables), name
    except Exception as e:  # a class whose build needs real variables
        _warn.warn(
            f"kmp counted the state of {name} on a copy built on the model's "
            "own variables, which holds as much memory as that state until "
            f"it is dropped: it could not be built on stand-ins ({e!r})."
        )
    counted = copy(optimizer.get_config())
    counted.build(model.trainable_variables)
    return live_tensors.nbytes(counted.variables), name


def _stand_ins(variables) -> list:
    """A variable like each of `variables` (shape, dtype, path, and the
    attributes optimizers read), made in the current graph."""
    stand_ins = []
    for variable in variables:
        path = getattr(variable, "path", variable.name)
        stand_in = keras.Variable(
            initializer="zeros",
            shape=variable.shape,
            dtype=variable.dtype,
            trainable=variable.trainable,
            name=path.rsplit("/", 1)[-1],
        )
        keras_private.with_path(stand_in, path)
        for attribute in ("overwrite_with_gradient",):
            if hasattr(variable, attribute):
                setattr(stand_in, attribute, getattr(variable, attribute))
        stand_ins.append(stand_in)
    return stand_ins


def estimate_memory(
    model: keras.Model, make_inputs: Callable[[int], Any], optimizer: Any = None
) -> MemoryEstimate:
    """Estimates, before training, the tensors a training step of `model`
    holds at its peak: weights, optimizer state, and the step's own tensors
    measured by forward and backward passes at two small batch sizes. The
    model's state is left as it was (the moving statistics a normalization
    layer updates are restored).

    Args:
        model: A built Keras model, under the policy to estimate.
        make_inputs: `n -> a batch of n inputs` (what `model` is called on).
        optimizer: The optimizer training will use (a copy is built on
            stand-ins of the variables, which hold no memory, to count its
            state); by default `model.optimizer`, else Adam.

    Returns:
        A `MemoryEstimate` (`total_mb(batch_size)`, `largest_batch(budget)`).
        On a CPU, its step figures leave out tensors under 256 KiB
        (`uncounted_below_mb`).

    Raises:
        RuntimeError: where TensorFlow keeps no count of live tensors on
            the device (a CPU with oneDNN turned off).
        NotImplementedError: on a Keras backend other than TensorFlow.

    Example:

    >>> model = keras.Sequential([
    ...     keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, padding="same")])
    >>> est = kmp.debug.estimate_memory(
    ...     model, lambda n: np.zeros((n, 32, 32, 3), "float32"))
    >>> est.weights_mb * 2**20, est.optimizer_mb * 2**20  # bytes
    (3584.0, 7180.0)
    >>> est.per_sample_mb > 0.125  # the 32 x 32 x 32 float32 output, at least
    True
    >>> est.total_mb(64) > est.total_mb(32)
    True
    """
    backends.require_tensorflow(
        "kmp.debug.estimate_memory, which reads TensorFlow's count of live tensors,",
        "On JAX, train a few steps and read "
        "jax.devices()[0].memory_stats()['peak_bytes_in_use'] (GPUs and TPUs).",
    )
    state = [(v, v.numpy()) for v in model.non_trainable_variables]
    try:
        small, large = (
            live_tensors.step_peak(model, make_inputs(n)) for n in PROBE_BATCHES
        )
    finally:
        for variable, value in state:
            variable.assign(value)
    per_sample = max(0, large - small) / (PROBE_BATCHES[1] - PROBE_BATCHES[0])
    optimizer_bytes, optimizer_name = _optimizer_bytes(model, optimizer)
    return MemoryEstimate(
        weights_mb=live_tensors.nbytes(model.variables) / MIB,
        optimizer_mb=optimizer_bytes / MIB,
        optimizer=optimizer_name,
        gradients_mb=live_tensors.nbytes(model.trainable_variables) / MIB,
        step_mb=max(0.0, small - per_sample * PROBE_BATCHES[0]) / MIB,
        per_sample_mb=per_sample / MIB,
        uncounted_below_mb=live_tensors.smallest_counted() / MIB,
    )
