"""tf.keras 2 code through `kmp.mixed_precision`: the sequence of TensorFlow's
mixed-precision guide (its policy, its model, its `fit`, its custom loop),
written with the guide's calls and only the import line changed, under both
mixed policies. The guide downloads MNIST; here a learnable task of the same
shape (784 features, 10 classes) stands in, smaller."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import kmp
from kmp import mixed_precision  # was: from tensorflow.keras import mixed_precision


def digits_like(n, seed):
    """784 features in [0, 1), labels from a fixed random linear map."""
    rng = np.random.default_rng(seed)
    x = rng.random((n, 784)).astype("float32")
    w = np.random.default_rng(0).normal(size=(784, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int64")


def guide_model():
    inputs = keras.Input(shape=(784,), name="digits")
    num_units = 64  # the guide's figure on CPUs
    dense1 = layers.Dense(num_units, activation="relu", name="dense_1")
    x = dense1(inputs)
    dense2 = layers.Dense(num_units, activation="relu", name="dense_2")
    x = dense2(x)
    x = layers.Dense(10, name="dense_logits")(x)
    outputs = layers.Activation("softmax", dtype="float32", name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs), dense1, x


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_the_guides_policy_and_model(name):
    policy = mixed_precision.Policy(name)
    mixed_precision.set_global_policy(policy)
    compute = name.removeprefix("mixed_")
    assert (policy.compute_dtype, policy.variable_dtype) == (compute, "float32")
    mixed_precision.set_global_policy(name)  # the guide's short form
    assert mixed_precision.global_policy().name == name
    assert kmp.get_policy().name == name  # set through kmp
    model, dense1, logits = guide_model()
    assert dense1.dtype_policy.name == name
    assert logits.dtype == compute and dense1.kernel.dtype == "float32"
    assert model.outputs[0].dtype == "float32"
    # dtype=mixed_precision.Policy("float32") on a layer, as the guide says.
    assert layers.Dense(2, dtype=mixed_precision.Policy("float32")).compute_dtype == (
        "float32"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_the_guides_fit_and_custom_loop(name):
    mixed_precision.set_global_policy(name)
    x_train, y_train = digits_like(4096, 1)
    x_test, y_test = digits_like(1024, 2)
    model, _, _ = guide_model()

    # Its fit: model.compile is Keras's, which under mixed_float16 wraps the
    # optimizer in Keras's own LossScaleOptimizer (tf.keras 2 did the same).
    model.compile(
        loss="sparse_categorical_crossentropy",
        optimizer=keras.optimizers.RMSprop(),
        metrics=["accuracy"],
    )
    initial_weights = model.get_weights()
    history = model.fit(
        x_train, y_train, batch_size=512, epochs=5, validation_split=0.2, verbose=0
    )
    test_scores = model.evaluate(x_test, y_test, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert test_scores[1] > 0.3  # chance is 0.1
    wrapped = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert wrapped == (name == "mixed_float16")
    assert not isinstance(model.optimizer, kmp.LossScaleOptimizer)

    # Its custom loop: kmp's loss scaling, through tf.keras 2's names.
    optimizer = keras.optimizers.RMSprop()
    optimizer = mixed_precision.LossScaleOptimizer(optimizer)
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    assert isinstance(optimizer, mixed_precision.LossScaleOptimizer)
    loss_object = keras.losses.SparseCategoricalCrossentropy()
    train_dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(10000).batch(512)
    )
    test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(512)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            predictions = model(x)
            loss = loss_object(y, predictions)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # noqa: B905
        return loss

    @tf.function
    def test_step(x):
        return model(x, training=False)

    model.set_weights(initial_weights)
    # The unscaled gradients are the loss's own (what a float32 tape gives).
    x0, y0 = x_train[:512], y_train[:512]
    with tf.GradientTape() as tape:
        plain_loss = loss_object(y0, model(x0))
    plain = tape.gradient(plain_loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        scaled_loss = optimizer.get_scaled_loss(loss_object(y0, model(x0)))
    scaled = tape.gradient(scaled_loss, model.trainable_variables)
    unscaled = optimizer.get_unscaled_gradients(scaled)
    assert float(optimizer.loss_scale) == 32768.0
    for u, p, s in zip(unscaled, plain, scaled, strict=True):
        np.testing.assert_allclose(u, p, rtol=0.05, atol=1e-4)
        assert np.abs(s).max() > 1000 * np.abs(p).max()  # scaled indeed

    losses = []
    for _epoch in range(5):
        epoch_loss_avg = keras.metrics.Mean()
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        for x, y in train_dataset:
            loss = train_step(x, y)
            epoch_loss_avg(loss)
        for x, y in test_dataset:
            predictions = test_step(x)
            test_accuracy.update_state(y, predictions)
        losses.append(float(epoch_loss_avg.result()))
    assert losses[-1] < losses[0]
    assert float(test_accuracy.result()) > 0.3
    steps = 5 * len(train_dataset)
    assert int(optimizer.iterations) + int(optimizer.skipped_steps_total) == steps
    assert int(optimizer.skipped_steps_total) <= 2
    assert optimizer.dynamic and int(optimizer.dynamic_counter) > 0


def test_the_one_line_that_brings_kmps_loss_scaling_to_fit():
    mixed_precision.set_global_policy("mixed_float16")
    model, _, _ = guide_model()
    kmp.compile(model, loss="sparse_categorical_crossentropy", optimizer="rmsprop")
    # Keras 3's contract, which fit's trainer follows (not tf.keras 2's).
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert not isinstance(model.optimizer, mixed_precision.LossScaleOptimizer)
    x, y = digits_like(64, 3)
    history = model.fit(x, y, batch_size=32, verbose=0)
    assert "loss_scale" in history.history


def test_tf_keras_2_loss_scale_optimizer_arguments():
    opt = mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=2.0**10, dynamic_growth_steps=3
    )
    assert (opt.mode, opt.initial_scale, opt.dynamic_growth_steps) == (
        "dynamic",
        1024.0,
        3,
    )
    fixed = mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=128
    )
    assert fixed.mode == "static" and not fixed.dynamic
    assert fixed.dynamic_counter is None and float(fixed.loss_scale) == 128.0
    # Its type says its contract: a kmp optimizer, with tf.keras 2's apply.
    assert isinstance(opt, kmp.LossScaleOptimizer)
    assert not isinstance(kmp.LossScaleOptimizer("sgd"), type(opt))
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(fixed))
    assert type(clone) is mixed_precision.LossScaleOptimizer
    assert (clone.mode, float(clone.loss_scale)) == ("static", 128.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dynamic": False}, ValueError, "initial_scale must be given"),
        (
            {"dynamic": False, "initial_scale": 8, "dynamic_growth_steps": 10},
            ValueError,
            "dynamic_growth_steps must be None",
        ),
        ({"dynamic": "yes"}, TypeError, "dynamic must be True or False"),
    ],
)
def test_tf_keras_2_loss_scale_optimizer_refuses_what_tf_keras_2_refused(
    kwargs, error, message
):
    with pytest.raises(error, match=message):
        mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_the_guides_fit_without_kmp_compile_is_named_once(caplog):
    mixed_precision.set_global_policy("mixed_float16")
    model, _, _ = guide_model()
    model.compile(loss="sparse_categorical_crossentropy", optimizer="rmsprop")
    x, y = digits_like(64, 3)
    with caplog.at_level("WARNING", logger="kmp"):
        for _ in range(2):  # a new monitor each time: named once per model
            model.fit(x, y, batch_size=32, verbose=0,
                      callbacks=[kmp.callbacks.LossScaleMonitor()])  # fmt: skip
        kmp.debug.find_nonfinite(model, x[:4])
    said = [r.getMessage() for r in caplog.records if "kmp.compile" in r.getMessage()]
    assert len(said) == 1
    assert "compiled with model.compile" in said[0]
    assert "Keras's own LossScaleOptimizer around RMSprop" in said[0]
    # The same tools say nothing about a model kmp compiled.
    caplog.clear()
    kmp_model, _, _ = guide_model()
    kmp.compile(kmp_model, loss="sparse_categorical_crossentropy", optimizer="rmsprop")
    with caplog.at_level("WARNING", logger="kmp"):
        kmp.debug.find_nonfinite(kmp_model, x[:4])
        kmp.precision_report(kmp_model)
    assert not [r for r in caplog.records if "model.compile" in r.getMessage()]


def test_fit_refuses_the_tf_keras_2_contract_with_the_fix():
    # Keras's train_step hands apply_gradients the gradients of scale_loss,
    # which tf.keras 2's apply_gradients does not take.
    mixed_precision.set_global_policy("mixed_float16")
    x, y = digits_like(64, 3)
    model, _, _ = guide_model()
    tf_keras_2 = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(loss="sparse_categorical_crossentropy", optimizer=tf_keras_2)
    with pytest.raises(kmp.LossScaleError, match=r"kmp\.compile\(model, optimizer"):
        model.fit(x, y, batch_size=32, verbose=0)
    with pytest.raises(ValueError, match=r"optimizer=optimizer\.inner_optimizer"):
        kmp.compile(
            guide_model()[0],
            loss="sparse_categorical_crossentropy",
            optimizer=tf_keras_2,
        )


class TfKeras2StepModel(keras.Model):
    """A train_step written for tf.keras 2's mixed-precision API."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled_loss = self.optimizer.get_scaled_loss(loss)
        scaled = tape.gradient(scaled_loss, self.trainable_variables)
        grads = self.optimizer.get_unscaled_gradients(scaled)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))  # noqa: B905
        return self.get_metrics_result()


def regression_model(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    head = keras.layers.Dense(1, name="head")
    return cls(inputs, head(keras.layers.Dense(8)(inputs)))


def test_a_tf_keras_2_train_step_trains_as_written_under_kmp_compile():
    x = np.random.RandomState(0).randn(64, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    mixed_precision.set_global_policy("mixed_float16")
    # The reference: the same model with Keras's own train_step, kmp.compile.
    reference = regression_model(keras.Model)
    # Its head in float32, as kmp computes an output a train_step receives.
    kmp.set_layer_policy("name:head", "float32")
    kmp.compile(reference, optimizer=keras.optimizers.SGD(0.05), loss="mse")
    kmp.clear_layer_policies()
    initial = reference.get_weights()
    model = regression_model(TfKeras2StepModel)
    model.set_weights(initial)
    optimizer = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    kmp.compile(model, optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    expected = reference.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert np.abs(model.get_weights()[0] - initial[0]).max() > 0.1  # it trained
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert history.history["loss_scale"] == expected.history["loss_scale"]
    assert int(optimizer.iterations) + int(optimizer.skipped_steps_total) == 8
