"""kmp.float32_scope: custom code computes in float32 and hands back what
its caller expects, in a layer, a train_step, a custom loop and a strategy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp


def dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


@kmp.float32_scope
def variance(x):
    """E[x^2] - E[x]^2: exact in float32 for values near 300, far off in
    bfloat16 (x^2 near 90000 is rounded to a multiple of 512)."""
    return keras.ops.mean(x * x, axis=-1) - keras.ops.square(keras.ops.mean(x, axis=-1))


def plain_variance(x):
    return keras.ops.mean(x * x, axis=-1) - keras.ops.square(keras.ops.mean(x, axis=-1))


SENSOR = np.array([[300.0, 302.0, 300.0, 302.0]], dtype="float32")  # variance 1


def test_the_decorator_computes_in_float32_and_returns_the_inputs_dtype():
    x = tf.constant(SENSOR, dtype="bfloat16")  # 300 and 302 are exact in bfloat16
    y = variance(x)
    assert dtype(y) == "bfloat16"
    assert float(y[0]) == 1.0
    # The same code without the scope computes in bfloat16 and is far off.
    assert abs(float(plain_variance(x)[0]) - 1.0) > 100


def test_the_decorator_works_traced_with_the_same_result():
    x = tf.constant(SENSOR, dtype="bfloat16")
    traced = tf.function(variance)
    assert float(traced(x)[0]) == 1.0
    assert dtype(traced(x)) == "bfloat16"


def test_the_decorator_adds_no_op_to_float32_code():
    x = tf.constant(SENSOR)
    plain = tf.function(plain_variance).get_concrete_function(x).graph
    scoped = tf.function(variance).get_concrete_function(x).graph
    ops = lambda g: sorted(op.type for op in g.get_operations())  # noqa: E731
    assert ops(scoped) == ops(plain)


def test_inputs_in_several_float_dtypes_need_a_named_output_dtype():
    @kmp.float32_scope
    def add(a, b):
        return a + b

    a = tf.ones((2,), "bfloat16")
    b = tf.ones((2,), "float32")
    with pytest.raises(ValueError, match=r"bfloat16, float32.*output_dtype"):
        add(a, b)

    add_16 = kmp.float32_scope(output_dtype="float16")(add.__wrapped__)
    assert dtype(add_16(a, b)) == "float16"


def test_integer_inputs_pass_and_outputs_stay_float32_without_float_inputs():
    @kmp.float32_scope
    def embed(ids, table):
        return keras.ops.take(table, ids, axis=0)

    ids = tf.constant([0, 1])
    table = np.ones((3, 2), "float32")  # a NumPy array is left as it is
    out = embed(ids, table)
    assert dtype(out) == "float32"

    @kmp.float32_scope
    def count(ids):
        return keras.ops.cast(keras.ops.sum(ids), "float32"), ids

    total, same = count(ids)
    assert dtype(total) == "float32" and same is ids


def test_a_with_block_reads_variables_in_float32_inside_a_mixed_layer():
    seen = {}

    class Scaled(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(), initializer="ones")

        def call(self, x):
            seen["outside"] = dtype(self.w.value)
            with kmp.float32_scope():
                seen["inside"] = dtype(self.w.value)
                y = keras.ops.cast(x, "float32") * self.w
            seen["after"] = dtype(self.w.value)
            return keras.ops.cast(y, x.dtype)

    layer = Scaled(dtype="mixed_bfloat16")
    assert dtype(layer(np.ones((2, 3), "float32"))) == "bfloat16"
    assert seen == {"outside": "bfloat16", "inside": "float32", "after": "bfloat16"}


def test_output_dtype_on_a_with_block_is_refused():
    scope = kmp.float32_scope(output_dtype="bfloat16")
    with pytest.raises(TypeError, match="decorated function"), scope:
        pass
    with pytest.raises(ValueError, match="floating dtype"):
        kmp.float32_scope(output_dtype="int32")
    with pytest.raises(TypeError, match="callable"):
        kmp.float32_scope()(3)


class SensorStd(keras.layers.Layer):
    """Typical sensor code: a standard deviation over the features, its
    variance part in float32 by the scope."""

    def call(self, x):
        var = variance(x)
        return keras.ops.sqrt(keras.ops.maximum(var, 0.0))[:, None]


def test_a_decorated_function_keeps_a_layers_interface_in_a_functional_model():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    y = SensorStd()(inputs)
    outputs = keras.layers.Dense(1)(y)
    model = keras.Model(inputs, outputs)
    assert dtype(model.layers[1].output) == "bfloat16"
    out = model(SENSOR)
    assert np.isfinite(keras.ops.convert_to_numpy(out)).all()


def test_a_scope_in_train_step_trains_under_mixed_float16():
    kmp.set_policy("mixed_float16")

    class Model(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                pred = self(x, training=True)
                with kmp.float32_scope():
                    loss = keras.ops.mean(
                        keras.ops.square(keras.ops.cast(pred, "float32") - y)
                    )
                scaled = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"mse": loss}

    inputs = keras.Input((4,))
    model = Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.05)))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    history = model.fit(x, y, batch_size=16, epochs=5, verbose=0)
    assert history.history["mse"][-1] < 0.5 * history.history["mse"][0]


def test_a_scope_in_a_custom_loop_under_a_strategy(mirrored):
    with mirrored.scope():
        kmp.set_policy("mixed_float16")
        model = keras.Sequential(
            [keras.Input((4,)), SensorStd(), keras.layers.Dense(1)]
        )
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=64)
        opt.build(model.trainable_variables)

    @tf.function
    def step(batch):
        def replica_step(inputs):
            bx, by = inputs
            with kmp.ScaledGradientTape(opt) as tape:
                pred = model(bx)
                with kmp.float32_scope():
                    loss = tf.reduce_mean(tf.square(tf.cast(pred, "float32") - by))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables, scaled=False)
            return loss

        return mirrored.run(replica_step, args=(batch,))

    x = np.tile(SENSOR, (16, 1))
    y = np.ones((16, 1), "float32")
    data = mirrored.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )
    losses = [mirrored.experimental_local_results(step(b)) for b in data]
    assert all(np.isfinite(float(v)) for per_replica in losses for v in per_replica)
    assert kmp.debug.verify_replicas(opt) == 2


def test_float64_inputs_are_left_as_they_are():
    @kmp.float32_scope
    def add(a, b):
        return a + keras.ops.cast(b, "float64")

    a = tf.constant([1.0 + 2.0**-40], "float64")  # lost in float32
    out = add(a, tf.ones((1,), "float32"))
    assert dtype(out) == "float64"
    assert float(out[0]) == 2.0 + 2.0**-40
