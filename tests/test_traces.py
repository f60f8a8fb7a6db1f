"""kmp.compile and the first fit step trace a model's call at most once more
than plain Keras's compile and first step, and later fits no more than
Keras's: the plan reads one read-only trace, and nothing is traced again
to check a choice."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

TRACES = []


def counted():
    if not tf.executing_eagerly():
        TRACES.append(1)


class Counted(keras.layers.Layer):
    def call(self, x):
        counted()
        return x


def functional():
    inputs = keras.Input((8,))
    h = Counted()(keras.layers.Dense(16, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(h))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        counted()
        return self.head(self.hidden(x))


def subclassed_built():
    model = Net()
    model(np.ones((2, 8), "float32"))
    return model


class Mixes(Net):
    """Its call joins the head's output with a 16-bit tensor in raw
    TensorFlow: the plan keeps the head's dtype, read from its trace."""

    def call(self, x):
        counted()
        h = self.hidden(x)
        y = self.head(h)
        self.add_loss(tf.cast(tf.reduce_mean(tf.square(y - h[:, :1])), "float32"))
        return y


def mixes_built():
    model = Mixes()
    model(np.ones((2, 8), "float32"))
    return model


class Attends(keras.Model):
    """A Keras attention layer in user code, its scores kept inside."""

    def __init__(self):
        super().__init__()
        self.attention = keras.layers.MultiHeadAttention(2, 4)
        self.head = keras.layers.Dense(1)

    def call(self, x):
        counted()
        return self.head(self.attention(x, x)[:, 0])


def attention_built():
    model = Attends()
    model(np.ones((2, 4, 8), "float32"))
    return model


class TwoInputs(keras.Model):
    """Not built before fit, and called on two inputs."""

    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(4)
        self.b = keras.layers.Dense(4)
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        counted()
        joined = keras.ops.concatenate([self.a(inputs[0]), self.b(inputs[1])], -1)
        return self.head(joined)


def fit_traces(model, compile_model, x, y):
    """The traces of compile + the first fit step, of compile alone, and of
    a second fit."""
    del TRACES[:]
    compile_model(model)
    compiling = len(TRACES)
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    first = len(TRACES)
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    return first, compiling, len(TRACES) - first


# Every model under float16 (where kmp checks the most: attention scores,
# loss scaling); the plain ones, and a model called on a tuple, under
# bfloat16.
CASES = [
    *[
        (build, "mixed_float16")
        for build in (functional, subclassed_built, mixes_built, attention_built)
    ],
    (functional, "mixed_bfloat16"),
    (subclassed_built, "mixed_bfloat16"),
    (TwoInputs, "mixed_bfloat16"),
]


@pytest.mark.parametrize("build, policy", CASES)
def test_kmp_traces_at_most_once_more_than_keras(build, policy):
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    if build is attention_built:
        x = np.random.default_rng(0).normal(size=(32, 4, 8)).astype("float32")
    if build is TwoInputs:
        x = (x[:, :2], x[:, 2:5])
    y = np.ones((32, 1), "float32")

    keras.config.set_dtype_policy(policy)
    plain = fit_traces(build(), lambda m: m.compile(optimizer="adam", loss="mse"), x, y)
    kmp.set_policy(policy)
    ours = fit_traces(
        build(), lambda m: kmp.compile(m, optimizer="adam", loss="mse"), x, y
    )
    assert ours[0] <= plain[0] + 1, (ours, plain)
    assert ours[1] <= 1, ours  # the plan's one read-only trace
    assert ours[2] == plain[2], (ours, plain)
