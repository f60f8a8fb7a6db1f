"""Memory: kmp's training step holds no more than plain Keras's.

Read from TensorFlow's own allocator (the bytes of live tensors and their
peak: what a GPU's memory would hold), on a model whose weights and
optimizer state outweigh its activations, so that a copy of the weights or
of Adam's slots, made by the skip of a non-finite step or by the fused
update, would show at once (one copy of the weights is 16 MiB here, the
margin 1 MiB).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.backend import fused

MIB = 2**20


def wide_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2048,))
    hidden = keras.layers.Dense(2048, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10)(hidden))


def tensors_rise(way: str, policy: str) -> int:
    """The peak of live tensors over one epoch of `fit`, above what was
    live before it (weights, optimizer slots, data), in bytes."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if way == "keras":
        keras.mixed_precision.set_global_policy(policy)
        model = wide_mlp()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    else:
        kmp.set_policy(policy)
        model = wide_mlp()
        kmp.compile(
            model,
            optimizer=keras.optimizers.Adam(1e-3),
            loss=loss,
            fused_update=None if way == "kmp" else False,
        )
    rng = np.random.default_rng(0)
    x = rng.random((64, 2048), "float32")
    y = rng.integers(0, 10, 64)
    model.fit(x, y, batch_size=8, verbose=0)  # builds and traces
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(x, y, batch_size=8, verbose=0)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_kmp_holds_no_more_tensors_than_keras_at_the_same_policy(policy):
    assert fused.resolve(None, "adam", wide_mlp().trainable_variables) == (
        fused.default_for_machine()
    )
    keras_rise = tensors_rise("keras", policy)
    for way in ("kmp", "kmp-unfused"):
        rise = tensors_rise(way, policy)
        assert rise <= 1.02 * keras_rise + MIB, (way, rise / MIB, keras_rise / MIB)
    # The measure sees the gradients (the first layer's alone are 16 MiB).
    assert keras_rise > 16 * MIB
