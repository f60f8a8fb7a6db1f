"""TensorFlow's count of live tensors on the device a step runs on: the
peak of a forward and backward pass, what `kmp.debug.estimate_memory`
measures (`kmp.diagnostics.memory`)."""

from __future__ import annotations

import functools
import os
from typing import Any

import keras
import numpy as np

from kmp.backend import sparse

# The passes measured at each batch size.
PASSES = 3
# The tensor sizes tried to find the smallest that the memory count sees:
# powers of two from 256 bytes (the GPU allocator's smallest block) to 16 MiB.
_PROBE_SIZES = tuple(2**k for k in range(8, 25))


def nbytes(tensors) -> int:
    """The bytes of `tensors` (or variables), from their shapes and dtypes."""
    return sum(
        int(np.prod(t.shape))
        * np.dtype(keras.backend.standardize_dtype(t.dtype)).itemsize
        for t in tensors
    )


def device() -> str:
    """The device a step runs on, whose memory is measured."""
    import tensorflow as tf

    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


@functools.cache
def smallest_counted() -> int:
    """The smallest tensor, in bytes, that TensorFlow's memory count on
    the step's device (`device()`) sees, of `_PROBE_SIZES`: 0 where the
    smallest is seen (a GPU), 256 KiB on a CPU (oneDNN's allocator sends
    smaller requests to a pool it does not count), the largest tried where
    none is seen. Measured once per process: the device and its allocator's
    threshold do not change."""
    import tensorflow as tf

    where = device()
    for size in _PROBE_SIZES:
        before = tf.config.experimental.get_memory_info(where)["current"]
        with tf.device(where):
            probe = tf.fill((size // 4,), 1.0)
        seen = tf.config.experimental.get_memory_info(where)["current"] > before
        del probe
        if seen:
            return 0 if size == _PROBE_SIZES[0] else size
    return _PROBE_SIZES[-1]


def step_peak(model: keras.Model, batch: Any) -> int:
    """The peak of live tensors above those live before, over a forward
    and backward pass on `batch`: at least the gradients it returns, which
    are live together at its end (a CPU's count misses tensors under 256
    KiB). The median of `PASSES` passes: the order in which the runtime
    runs independent ops moves one pass's peak. Each pass is a function
    traced anew: a kernel keeps buffers from its first run, which its later
    runs reuse unseen."""
    import tensorflow as tf

    variables = model.trainable_variables

    def forward_backward(x):
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            # Any scalar of the outputs: the backward pass holds the same.
            loss = tf.add_n(
                [
                    tf.reduce_sum(tf.cast(o, tf.float32))
                    for o in tf.nest.flatten(outputs)
                ]
            )
        return tape.gradient(loss, variables)

    where = device()
    peaks = []
    for _ in range(PASSES):
        step = tf.function(forward_backward)
        step.get_concrete_function(batch)  # traced before the measurement
        try:
            tf.config.experimental.reset_memory_stats(where)
        except ValueError as e:
            if "Cannot reset memory stats" not in str(e):
                raise
            raise NoMemoryCount(_no_count_message(where, str(e))) from e
        before = tf.config.experimental.get_memory_info(where)["current"]
        grads = step(batch)
        peak = tf.config.experimental.get_memory_info(where)["peak"]
        peaks.append(max(peak - before, nbytes(sparse.tensors(grads))))
        del grads, step
    return sorted(peaks)[len(peaks) // 2]


class NoMemoryCount(RuntimeError):
    """TensorFlow keeps no count of live tensors on the device measured."""


def _no_count_message(device: str, error: str) -> str:
    """What is wrong, what TensorFlow said, and the fix where one is known."""
    message = (
        f"kmp.debug.estimate_memory measures a training step with TensorFlow's "
        f"count of live tensors on {device}, and this process keeps none. "
        f"TensorFlow said: {error}."
    )
    if device.startswith("CPU") and os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0":
        message += (
            " On a CPU, TensorFlow counts with its oneDNN allocator, turned off "
            "here. Received: TF_ENABLE_ONEDNN_OPTS=0. Unset it or set it to 1."
        )
    return message
