"""kmp.compile: the model's own compile arguments, every optimizer wrapped,
loss scaling decided from the model's own layers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.planning import decisions as planning


def mlp():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]
    )


def data(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), np.ones((n, 1), "float32")


def test_a_model_built_in_a_float16_scope_gets_loss_scaling_outside_it():
    with kmp.policy_scope("mixed_float16"):
        model = mlp()
    assert kmp.get_policy().name == "float32"
    kmp.compile(model, optimizer="sgd", loss="mse")
    assert model.optimizer.mode == "dynamic"
    assert "layers compute in float16" in kmp.precision_report(model).loss_scaling


def test_a_float16_part_of_a_float32_model_gets_loss_scaling():
    with kmp.policy_scope("mixed_float16"):
        encoder = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8)], name="encoder"
        )
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(encoder(inputs)))
    assert model.dtype_policy.name == "float32"
    kmp.compile(model, optimizer="sgd", loss="mse")
    assert model.optimizer.mode == "dynamic"


def test_no_float16_layer_means_no_scaling_but_skipping():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.compile(mlp(), optimizer="sgd", loss="mse")
    assert model.optimizer.mode == "none"
    assert "no layer computes in float16" in kmp.precision_report(model).loss_scaling


def test_positional_arguments_work_as_in_model_compile():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "sgd", "mse", metrics=["mae"])
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    history = model.fit(*data(), verbose=0)
    assert {"loss", "mae", "loss_scale"} <= set(history.history)


def test_auto_scale_loss_false_is_respected():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), optimizer="sgd", loss="mse", auto_scale_loss=False)
    assert model.optimizer.mode == "none"  # no scaling; non-finite steps skipped
    loss_scaling = kmp.precision_report(model, trace=False).loss_scaling
    assert "loss scaling is off (auto_scale_loss=False" in loss_scaling


def test_arguments_that_do_not_fit_the_models_compile_are_a_clear_error():
    with pytest.raises(TypeError, match=r"Sequential\.compile, which does not take"):
        kmp.compile(mlp(), optimizer="sgd", lossy="mse")


class GAN(keras.Model):
    """keras-io's DCGAN, in short: its own compile(d_optimizer, g_optimizer,
    loss_fn) and train_step."""

    def __init__(self):
        super().__init__()
        self.discriminator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]
        )
        self.generator = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(8), keras.layers.Dense(4)]
        )

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real):
        batch = tf.shape(real)[0]
        noise = tf.random.normal((batch, 2))
        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            logits = tf.cast(
                self.discriminator(tf.concat([fake, tf.cast(real, fake.dtype)], 0)),
                tf.float32,
            )
            labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], 0)
            d_loss = self.d_optimizer.scale_loss(self.loss_fn(labels, logits))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        with tf.GradientTape() as tape:
            logits = tf.cast(self.discriminator(self.generator(noise)), tf.float32)
            g_loss = self.g_optimizer.scale_loss(
                self.loss_fn(tf.zeros((batch, 1)), logits)
            )
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        # Keras's public reader of the model's metrics: kmp's telemetry too.
        return {"d_loss": d_loss, "g_loss": g_loss, **self.get_metrics_result()}


def test_a_model_with_its_own_compile_gets_each_optimizer_wrapped():
    kmp.set_policy("mixed_float16")
    gan = GAN()
    kmp.compile(
        gan,
        d_optimizer=keras.optimizers.Adam(1e-3),
        g_optimizer=keras.optimizers.Adam(1e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    assert isinstance(gan.d_optimizer, kmp.LossScaleOptimizer)
    assert isinstance(gan.g_optimizer, kmp.LossScaleOptimizer)
    assert gan.d_optimizer.mode == gan.g_optimizer.mode == "dynamic"
    history = gan.fit(np.random.rand(16, 4).astype("float32"), batch_size=8, verbose=0)
    for name in ("d_optimizer", "g_optimizer"):
        assert f"{name}_loss_scale" in history.history
        assert f"{name}_skipped_steps_total" in history.history
    loss_scaling = kmp.precision_report(gan, trace=False).loss_scaling
    assert "d_optimizer: dynamic" in loss_scaling and "g_optimizer" in loss_scaling


def test_positional_optimizers_of_a_custom_compile_are_wrapped_too():
    kmp.set_policy("mixed_float16")
    gan = GAN()
    kmp.compile(gan, "adam", keras.optimizers.SGD(), keras.losses.BinaryCrossentropy())
    assert isinstance(gan.d_optimizer, kmp.LossScaleOptimizer)
    assert isinstance(gan.g_optimizer.inner_optimizer, keras.optimizers.SGD)


class StarCompile(GAN):
    """A compile that takes its second optimizer through *args."""

    def compile(self, d_optimizer, *more, loss_fn=None):
        super().compile(d_optimizer, more[0], loss_fn)


def test_a_compile_with_star_args_gets_its_arguments_in_order_and_wrapped():
    kmp.set_policy("mixed_float16")
    gan = StarCompile()
    kmp.compile(
        gan,
        keras.optimizers.Adam(1e-3),
        keras.optimizers.SGD(1e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    assert isinstance(gan.d_optimizer.inner_optimizer, keras.optimizers.Adam)
    assert isinstance(gan.g_optimizer, kmp.LossScaleOptimizer)
    assert isinstance(gan.g_optimizer.inner_optimizer, keras.optimizers.SGD)
    history = gan.fit(np.random.rand(16, 4).astype("float32"), batch_size=8, verbose=0)
    assert np.isfinite(history.history["d_loss"]).all()


def test_an_optimizer_name_only_the_models_compile_knows_is_wrapped_after_it():
    class Task(keras.Model):
        """As KerasHub's tasks: optimizer='auto' resolved by its compile."""

        def compile(self, optimizer="auto", loss=None, **kwargs):
            if optimizer == "auto":
                optimizer = keras.optimizers.Adam(2e-5)
            super().compile(optimizer=optimizer, loss=loss, **kwargs)

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)(inputs)
    task = Task(inputs, keras.layers.Dense(1)(hidden))
    kmp.compile(task, loss="mse")
    assert isinstance(task.optimizer, kmp.LossScaleOptimizer)
    assert task.optimizer.mode == "dynamic"
    assert float(task.optimizer.inner_optimizer.learning_rate) == pytest.approx(2e-5)


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(8)
        self.b = keras.layers.Dense(1)

    def call(self, x):
        return self.b(self.a(x))


def test_a_subclassed_model_built_before_compile_gets_the_telemetry_in_its_logs(
    caplog,
):
    kmp.set_policy("mixed_float16")
    net = Net()
    net.build((None, 4))  # Keras locks a built subclassed model's state
    with caplog.at_level("WARNING", logger="kmp"):
        kmp.compile(net, optimizer="sgd", loss="mse")
    assert not caplog.records  # kmp's train function adds the telemetry
    assert isinstance(net.optimizer, kmp.LossScaleOptimizer)
    # Small inputs and targets: no float16 gradient overflows at 2**15.
    x, y = data()
    logs = net.fit(1e-3 * x, 0 * y, verbose=0).history
    # No per-epoch count: Keras resets only the metrics it tracks.
    assert logs["loss_scale"] == [32768.0] and logs["skipped_steps_total"] == [0]
    assert "skipped_steps" not in logs
    # Its call's output layer, found by tracing it: its output is cast.
    assert net.b.compute_dtype == "float16"
    assert kmp.precision_report(net).row(net.b.name).rule == planning.OUTPUT


@pytest.mark.parametrize("fused_update", [False, True])
@pytest.mark.parametrize("kind", ["functional", "subclassed-unbuilt"])
def test_fit_traces_its_first_step_once(kind, fused_update):
    # TensorFlow traces a step again where its first trace created variables;
    # kmp builds the optimizer before it (plain Keras builds it in the step).
    kmp.set_policy("mixed_float16")
    traces = []

    def loss(y, prediction):  # Python: runs at each trace of the step
        traces.append(prediction.dtype)
        return keras.ops.mean(keras.ops.square(y - prediction))

    model = mlp() if kind == "functional" else Net()
    adam = keras.optimizers.Adam(name="adam")
    kmp.compile(model, optimizer=adam, loss=loss, fused_update=fused_update)
    model.fit(*data(32), batch_size=8, epochs=2, verbose=0)
    assert traces == ["float32"]
    # Built for the variables the step applies, as its first apply does:
    # the same variables, with the same names.
    inner = model.optimizer.inner_optimizer
    applied = [id(v) for v in model.trainable_weights]
    assert [id(v) for v in inner._trainable_variables] == applied
    same = kmp.LossScaleOptimizer(keras.optimizers.Adam(name="adam"))
    grads = [keras.ops.zeros_like(v) for v in model.trainable_variables]
    same.apply(grads, model.trainable_variables, scaled=False)
    paths = [v.path.replace(same.name, model.optimizer.name, 1) for v in same.variables]
    assert [v.path for v in model.optimizer.variables] == paths


def _trains_its_head_only(overridden):
    """A functional model that trains its head only by overriding
    `overridden` (Keras's train_step applies `trainable_weights`)."""

    def without_body(self):
        weights = getattr(keras.Model, overridden).fget(self)
        return [w for w in weights if not w.path.startswith("body")]

    return type("HeadOnly", (keras.Model,), {overridden: property(without_body)})


@pytest.mark.parametrize("fused_update", [False, True])
@pytest.mark.parametrize("overridden", ["trainable_weights", "trainable_variables"])
def test_fit_builds_the_optimizer_for_the_weights_keras_step_applies(
    overridden, fused_update
):
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    body = keras.layers.Dense(4, name="body")
    head = keras.layers.Dense(4, name="head")
    model = _trains_its_head_only(overridden)(inputs, head(body(inputs)))
    optimizer = keras.optimizers.Adam(1e-2, use_ema=True)
    kmp.compile(model, optimizer=optimizer, loss="mse", fused_update=fused_update)
    body_kernel = body.kernel.numpy()
    x = np.random.default_rng(0).random((32, 4), "float32")
    model.fit(x, x, batch_size=8, verbose=0)
    applied = [id(w) for w in model.trainable_weights]
    assert [id(v) for v in optimizer._trainable_variables] == applied
    if overridden == "trainable_weights":
        np.testing.assert_array_equal(body.kernel.numpy(), body_kernel)
        # The moving averages Keras writes back at the end of fit are the
        # head's own, not the body's.
        assert not np.allclose(head.kernel.numpy(), body_kernel)
