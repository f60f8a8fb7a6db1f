"""kmp.tracing: what layers really compute in, read from a traced forward pass."""

import keras
import numpy as np
import tensorflow as tf

import kmp
from kmp.backend import tracing


class Attention16(keras.layers.Layer):
    """A user's attention written with raw ops: scores and softmax in the
    compute dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.q = keras.layers.Dense(8, name="q")
        self.k = keras.layers.Dense(8, name="k")

    def call(self, x):
        scores = keras.ops.matmul(self.q(x), keras.ops.transpose(self.k(x), (0, 2, 1)))
        return keras.ops.matmul(keras.ops.softmax(scores / 8.0), x)


def test_the_trace_reads_what_each_layer_computes_and_returns():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((5, 8))
    x = Attention16(name="att")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    head = keras.layers.Dense(2, activation="sigmoid", name="head")
    model = kmp.prepare(keras.Model(inputs, head(x)))
    result = tracing.trace(model)
    assert result.error is None
    att = result.of("att")
    assert att.softmax == ("bfloat16",) and att.scores == ("bfloat16",)
    assert att.returns == ("bfloat16",)
    assert result.of("att/q").computes == ("bfloat16",)
    norm = result.of("norm")
    assert norm.returns == ("bfloat16",) and "Rsqrt" in norm.float32_ops
    assert result.of("head").computes == ("float32",)
    assert result.outputs == ("float32",)


def test_a_layer_called_twice_is_attributed_both_times():
    kmp.set_policy("mixed_float16")
    shared = keras.layers.Dense(4, name="shared")
    once = keras.layers.Dense(4, name="once")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, once(shared(shared(inputs))))
    result = tracing.trace(model)
    assert result.of("shared").matmuls == 2
    assert result.of("once").matmuls == 1


def test_ops_are_attributed_whatever_the_numeric_suffixes_of_names():
    # TensorFlow adds suffixes to keep scope names unique: `dense` called
    # after a layer named `dense_1` lands in scope `dense_2`, `dense_1` in
    # `dense_1_1`. Each op must still land at its own layer.
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(3, name="dense_1")(inputs)
    x = keras.layers.Dense(5, name="dense")(x)
    x = keras.layers.Softmax(name="dense_1_1")(x)  # a name that looks like a scope
    model = keras.Model(inputs, keras.layers.Dense(2, name="functional_1")(x))
    result = tracing.trace(kmp.prepare(model))
    assert result.of("dense_1").matmuls == result.of("dense").matmuls == 1
    assert result.of("dense_1_1").softmax == ("float32",)  # a float32 island
    assert result.of("dense").softmax == ()
    assert result.of("functional_1").computes == ("bfloat16",)  # output: a cast


def test_an_unbuilt_model_cannot_be_traced_and_says_why():
    class Net(keras.Model):
        def call(self, x):
            return x

    result = tracing.trace(Net())
    assert result.layers == {} and "not built" in result.error
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    assert "not built" in tracing.trace(unbuilt).error


def test_a_subclassed_model_built_by_a_call_is_traced():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2, name="d")

        def call(self, x):
            return self.d(x)

    kmp.set_policy("mixed_bfloat16")
    net = Net()
    net(np.ones((3, 4)))
    result = tracing.trace(net)
    assert result.error is None and result.of("d").computes == ("bfloat16",)
    assert result.outputs == ("bfloat16",)


def test_code_that_meets_an_output_is_read_from_one_trace():
    kmp.set_policy("mixed_bfloat16")

    class Net(keras.Model):
        def __init__(self, join):
            super().__init__()
            self.hidden = keras.layers.Dense(4)
            self.head = keras.layers.Dense(1)
            self.out = keras.layers.Dense(1)
            self.join = join

        def call(self, x):
            h = self.hidden(x)
            y = self.head(h)
            if self.join == "scale":
                return y * 2.0  # a Python number: made in y's dtype
            if self.join == "layer":
                return self.out(y)  # a Keras layer casts what it takes
            if self.join == "center":  # y meets only what it computes
                return y - tf.reduce_mean(y, -1, keepdims=True)
            if self.join == "typed":  # a constant made 16-bit
                return y * tf.constant(0.5, dtype=self.compute_dtype)
            return y - h[:, :1]  # raw TensorFlow: y meets a 16-bit tensor

    found = {}
    joins = ("scale", "layer", "center", "typed", "raw")
    for join in joins:
        net = Net(join)
        net(np.ones((2, 3)))
        traced = tracing.forward(net)
        assert traced.error is None
        found[join] = tracing.float32_output_mixes(net, traced, net.head)
    assert found == {
        "scale": None,
        "layer": None,
        "center": None,
        "typed": "Mul in Net",
        "raw": "Sub in Net",
    }
