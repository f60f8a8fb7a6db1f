"""Models users write themselves, from keras-io's code (random data with the
originals' shapes, sizes cut for speed): a subclassed VAE with its own
`train_step` and `metrics`, a `compute_loss` override with an activity
regularizer, knowledge distillation, a U-Net's `clear_session()`; each run
as written plus kmp's two lines, and compared with float32."""

import functools
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras import ops

import kmp

MIXED = ["mixed_float16", "mixed_bfloat16"]
COMPUTE = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


# --- keras-io: examples/generative/vae.py (Keras 3) ----------------------------


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        # The one fix: keras-io draws the noise in float32 (no dtype=).
        epsilon = keras.random.normal(
            shape=(batch, dim), dtype=z_mean.dtype, seed=self.seed_generator
        )
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def vae_encoder_decoder(latent_dim=2):
    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(
        encoder_inputs
    )
    x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 64))(x)
    x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(
        1, 3, activation="sigmoid", padding="same"
    )(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return encoder, decoder


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(
            name="reconstruction_loss"
        )
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
            # The README's line (keras-io differentiates total_loss).
            scaled_loss = self.optimizer.scale_loss(total_loss)
        grads = tape.gradient(scaled_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))  # noqa: B905
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


@functools.cache
def vae_float32_logs():
    return train_vae("float32")[1]


def train_vae(policy):
    keras.utils.set_random_seed(0)
    kmp.set_policy(policy)
    vae = VAE(*vae_encoder_decoder())
    kmp.compile(vae, optimizer=keras.optimizers.Adam())
    digits = np.random.RandomState(0).rand(768, 28, 28, 1).astype("float32")
    history = vae.fit(digits, epochs=1, batch_size=64, verbose=0)
    return vae, history.history


@pytest.mark.slow
@pytest.mark.xdist_group("vae")  # one worker trains the float32 reference once
@pytest.mark.parametrize("policy", MIXED)
def test_keras_io_vae_trains_like_float32_with_its_skips_in_history(policy):
    reference = vae_float32_logs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to say
        vae, logs = train_vae(policy)
    # Its encoder's and decoder's outputs reach its train_step in float32,
    # so the binary cross-entropy is computed in float32 (in float16 it
    # overflowed: most steps were skipped).
    assert vae.decoder.layers[-1].compute_dtype == "float32"
    assert vae.encoder.get_layer("z_mean").compute_dtype == "float32"
    assert logs["loss"][-1] == pytest.approx(reference["loss"][-1], rel=0.01)
    # Its train_step returns its own dict and its model overrides `metrics`:
    # the skips still reach History (its total: nothing resets a per-epoch
    # count for it).
    assert logs["skipped_steps_total"] == [0.0] or policy == "mixed_float16"
    assert logs["skipped_steps_total"][-1] <= 1  # a scale that grows may skip one
    assert ("loss_scale" in logs) == (policy == "mixed_float16")
    assert "skipped_steps" not in logs


# --- keras.Model subclass overriding compute_loss (Keras's own docstring) ----


class Regressor(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = layers.Dense(64, activation="relu")
        self.d2 = layers.Dense(
            64, activation="relu", activity_regularizer=keras.regularizers.L2(1e-4)
        )
        self.out = layers.Dense(1)

    def call(self, x):
        return self.out(self.d2(self.d1(x)))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):  # fmt: skip
        loss = ops.mean((y_pred - y) ** 2)
        loss += ops.sum(self.losses)
        return loss


def regression_data():
    rs = np.random.RandomState(0)
    x = rs.randn(512, 16).astype("float32")
    y = (x @ rs.randn(16, 1) + 0.1 * rs.randn(512, 1)).astype("float32")
    return x, y


@functools.cache
def regressor_float32_logs(build_first):
    return train_regressor("float32", build_first)[1]


def train_regressor(policy, build_first):
    keras.utils.set_random_seed(0)
    kmp.set_policy(policy)
    model = Regressor()
    x, y = regression_data()
    if build_first:
        model(x[:2])
    kmp.compile(
        model,
        optimizer=keras.optimizers.Adam(1e-3),
        steps_per_execution=4,
        jit_compile=True,
    )
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model, history.history


@pytest.mark.slow
@pytest.mark.xdist_group("regressor")  # one worker trains each reference once
# Each way of building under one policy, the policies taken in turn: the
# output layer is found the same way under both (only the loss scaling
# differs), so both ways and both policies still train, at half the cost.
@pytest.mark.parametrize(
    "policy, build_first",
    [("mixed_float16", False), ("mixed_bfloat16", True)],
    ids=["mixed_float16-unbuilt", "mixed_bfloat16-built"],
)
def test_a_compute_loss_override_trains_like_float32(policy, build_first):
    reference = regressor_float32_logs(build_first)
    model, logs = train_regressor(policy, build_first)
    # The layer its call returns computes in float32 (found by tracing the
    # call: at compile time, or once fit has built an unbuilt model), and
    # the activity-regularization loss is float32.
    assert model.out.compute_dtype == "float32"
    assert model.d2.compute_dtype != "float32"
    model(regression_data()[0][:2])  # the losses of this call: one, float32
    dtypes = [keras.backend.standardize_dtype(t.dtype) for t in model.losses]
    assert dtypes == ["float32"]
    np.testing.assert_allclose(logs["loss"], reference["loss"], rtol=0.02)
    assert logs["skipped_steps_total"][-1] == 0


def test_an_activity_regularizer_is_saved_as_the_user_wrote_it(tmp_path):
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    hidden = layers.Dense(
        8, activity_regularizer=keras.regularizers.L2(1e-3), name="hidden"
    )(inputs)
    model = keras.Model(inputs, layers.Dense(1)(hidden))
    kmp.compile(model, optimizer="sgd", loss="mse")
    # Keras's own compute_loss fails on a 16-bit activity loss.
    loss = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0).history["loss"]
    assert np.isfinite(loss[0])
    model(np.ones((2, 4)))  # the losses of this call
    assert [keras.backend.standardize_dtype(t.dtype) for t in model.losses] == [
        "float32"
    ]
    config = model.get_layer("hidden").get_config()["activity_regularizer"]
    assert config == keras.regularizers.serialize(keras.regularizers.L2(1e-3))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras", compile=False)
    regularizer = loaded.get_layer("hidden").activity_regularizer
    assert type(regularizer) is keras.regularizers.L2


# --- keras-io: examples/vision/knowledge_distillation.py ------------------------


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn,
                alpha=0.1, temperature=3):  # fmt: skip
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     allow_empty=False):  # fmt: skip
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def small_convnet(name, filters):
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(filters, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Flatten(),
            layers.Dense(10),
        ],
        name=name,
    )


@pytest.mark.parametrize("policy", MIXED)
def test_a_distillers_loss_gets_the_teacher_and_student_outputs_in_float32(policy):
    kmp.set_policy(policy)
    teacher = small_convnet("teacher", 16)
    student = small_convnet("student", 4)
    x = np.random.RandomState(0).rand(64, 28, 28, 1).astype("float32")
    y = np.random.RandomState(1).randint(0, 10, 64)
    kmp.compile(
        teacher,
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    teacher.fit(x, y, epochs=1, verbose=0)
    # Trained alone, its output goes to Keras's loss: a cast.
    assert teacher.layers[-1].compute_dtype == COMPUTE[policy]
    assert teacher.predict(x[:2], verbose=0).dtype == "float32"
    distiller = Distiller(student=student, teacher=teacher)
    kmp.compile(
        distiller,
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
    )
    history = distiller.fit(x, y, epochs=1, verbose=0)
    # Its compute_loss receives the teacher's output and what its call
    # returns (the student's): both float32, once fit has built it.
    assert teacher.layers[-1].compute_dtype == "float32"
    assert student.layers[-1].compute_dtype == "float32"
    assert teacher(x[:2]).dtype == teacher.predict(x[:2], verbose=0).dtype == "float32"
    assert np.isfinite(history.history["loss"][-1])
    rule = kmp.planning.decisions.plan(distiller).decision(
        "teacher/" + teacher.layers[-1].name
    )
    assert rule.rule == kmp.planning.decisions.CALLED_OUTPUT


# --- a model output that the model's own call also mixes with 16-bit tensors -------


class AuxiliaryLoss(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = layers.Dense(8)
        self.head = keras.Sequential([layers.Dense(1)], name="head")

    def call(self, x):
        h = self.embed(x)
        y = self.head(h)
        # Raw TensorFlow (`-` on tensors): no dtype promotion.
        self.add_loss(tf.reduce_mean(tf.square(y - h[:, :1])))
        return y

    def train_step(self, data):  # its own: kmp gives it float32 outputs
        return super().train_step(data)


def test_an_output_that_the_models_own_call_mixes_keeps_its_dtype():
    kmp.set_policy("mixed_bfloat16")
    model = AuxiliaryLoss()
    model(np.ones((2, 4)))
    kmp.prepare(model)
    head = "head/" + model.head.layers[0].name
    decision = kmp.planning.decisions.plan(model).decision(head)
    assert decision.policy.compute_dtype == "bfloat16"
    assert "meet a 16-bit tensor in Sub in AuxiliaryLoss" in decision.note
    assert model(np.ones((2, 4))).dtype == "bfloat16"  # still runs


# --- keras-io's U-Net: clear_session() after the policy was set -------------------


def test_compile_says_when_clear_session_undid_the_policy():
    kmp.set_policy("mixed_float16")
    keras.backend.clear_session()  # resets Keras's global dtype policy
    model = keras.Sequential([keras.Input((4,)), layers.Dense(2)])
    with pytest.warns(UserWarning, match=r"set_policy\('mixed_float16'\) is no longer"):
        kmp.compile(model, optimizer="sgd", loss="mse")
    assert "no longer in force" in str(kmp.precision_report(model))
    kmp.set_policy("mixed_float16")
    rebuilt = keras.Sequential([keras.Input((4,)), layers.Dense(2)])
    kmp.compile(rebuilt, optimizer="sgd", loss="mse")  # no warning: in force
    assert kmp.precision_report(rebuilt).policy_lost == ""


# --- the logs of a train_step that returns its own dict ----------------------------


class OwnLogs(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="loss")

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def test_a_train_steps_own_logs_get_the_telemetry_per_epoch():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = OwnLogs(inputs, layers.Dense(1)(layers.Dense(8)(inputs)))
    kmp.compile(model, optimizer="sgd", loss="mse")
    x, y = np.ones((16, 4)), np.ones((16, 1))
    logs = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    assert logs["loss_scale"] == [32768.0, 32768.0]
    assert logs["skipped_steps"] == [0.0, 0.0]
    assert logs["skipped_steps_total"] == [0.0, 0.0]
    # train_on_batch returns what the train_step returns.
    assert set(model.train_on_batch(x, y, return_dict=True)) == {"loss"}


# --- the audit of models users write ---------------------------------------------


def test_the_audit_of_a_model_with_no_call_traces_the_models_it_holds():
    kmp.set_policy("mixed_float16")
    vae = VAE(*vae_encoder_decoder())
    audit = kmp.debug.precision_audit(vae)
    assert audit.not_traced == ""  # its encoder and decoder were traced
    outputs = {r.layer for r in audit if r.kind == "16-bit output"}
    assert {"encoder/z_mean", "encoder/z_log_var"} <= outputs
    assert "VAE.call" not in str(audit)  # every fix names code that exists
    kmp.compile(vae, optimizer="adam")
    assert not any(r.kind == "16-bit output" for r in kmp.debug.precision_audit(vae))


class KerasIoSampling(layers.Layer):
    """keras-io's Sampling as written: the noise is float32."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean))
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class Encoder(keras.Model):
    def __init__(self):
        super().__init__()
        self.mean = layers.Dense(2)
        self.log_var = layers.Dense(2)
        self.sampling = KerasIoSampling()
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.sampling([self.mean(x), self.log_var(x)]))


def test_the_audit_names_the_line_that_mixes_a_float32_tensor_in():
    with kmp.policy_scope("float32"):
        model = Encoder()
        model(np.ones((2, 4)))
    audit = kmp.debug.precision_audit(model, policy="mixed_float16")
    (risk,) = [r for r in audit if r.kind == "dtype error"]
    assert risk.layer.startswith("test_user_models.py:")
    assert risk.class_name == "KerasIoSampling"
    assert "ops.exp(0.5 * z_log_var) * epsilon" in risk.detail
    assert "dtype=x.dtype" in risk.fix
    assert str(audit).startswith("Could not check all of")


# --- the plan completed once the model is built, however it is built ---------------


class Classifier(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = layers.Dense(8)
        self.head = layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.head(self.hidden(x))


def test_an_unbuilt_model_trained_first_by_train_on_batch_gets_its_output_rule():
    kmp.set_policy("mixed_bfloat16")
    model = Classifier()
    kmp.compile(model, optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = np.ones((8, 4), "float32"), np.zeros((8,), "int32")
    model.predict(x, verbose=0)  # before any fit: built, not planned again
    assert model.head.compute_dtype == "bfloat16"
    model.train_on_batch(x, y)  # a generator, no shapes: built by its trace
    assert model.head.compute_dtype == "float32"  # a softmax
    assert model.predict(x, verbose=0).dtype == "float32"
    model.train_on_batch(x, y)
    assert model.head.compute_dtype == "float32"


class TwoInputs(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = layers.Dense(4)
        self.b = layers.Dense(4)
        self.head = layers.Dense(1)

    def call(self, inputs):
        return self.head(ops.concatenate([self.a(inputs[0]), self.b(inputs[1])], -1))


def test_a_model_with_several_inputs_is_planned_after_its_first_step():
    kmp.set_policy("mixed_bfloat16")
    model = TwoInputs()
    kmp.compile(model, optimizer="sgd", loss="mse")
    x = (np.ones((8, 2), "float32"), np.ones((8, 3), "float32"))
    history = model.fit(x, np.ones((8, 1)), batch_size=4, epochs=2, verbose=0)
    # Its inputs are a tuple: kmp does not build it before the first step;
    # that step's trace builds it, and the plan is completed after it.
    rule = kmp.planning.applied.applied(model.head).rule
    assert rule == kmp.planning.decisions.OUTPUT
    assert kmp.precision_report(model).not_traced == ""
    assert np.isfinite(history.history["loss"]).all()


class EagerOnly(keras.Model):
    def __init__(self):
        super().__init__()
        self.head = layers.Dense(1)

    def call(self, x):
        if x.numpy().sum() < 0:  # only runs eagerly
            x = -x
        return self.head(x)


def test_a_call_that_cannot_be_traced_is_compiled_and_trained_as_keras_would():
    kmp.set_policy("mixed_bfloat16")
    model = EagerOnly()
    model(np.ones((2, 4)))
    kmp.compile(model, optimizer="sgd", loss="mse", run_eagerly=True)
    history = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0).history
    assert np.isfinite(history["loss"][0])
    assert "numpy" in kmp.precision_report(model).not_traced


class HeldButNotCalled(keras.Model):
    """A model its call does not run (an EMA copy), and no train_step of its
    own: Keras's train_step only ever runs call."""

    def __init__(self):
        super().__init__()
        self.net = keras.Sequential([layers.Dense(1)], name="net")
        self.ema = keras.Sequential([layers.Dense(1)], name="ema")

    def call(self, x):
        return self.net(x)


def test_a_model_held_but_not_called_keeps_its_policy():
    kmp.set_policy("mixed_bfloat16")
    model = HeldButNotCalled()
    model(np.ones((2, 4)))
    model.ema(np.ones((2, 4)))
    kmp.prepare(model)
    # Its call returns net's output, which Keras's loss casts.
    assert model.net.layers[-1].compute_dtype == "bfloat16"
    path = f"net/{model.net.layers[-1].name}"
    assert kmp.planning.decisions.plan(model).decision(path).rule == (
        kmp.planning.decisions.OUTPUT
    )
    assert model.ema.layers[-1].compute_dtype == "bfloat16"


def test_a_teacher_whose_output_the_outer_call_mixes_keeps_its_dtype():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    backbone = keras.Model(inputs, layers.Dense(4, name="features")(inputs))

    class FineTune(keras.Model):
        def __init__(self):
            super().__init__()
            self.backbone = backbone
            self.meta = layers.Dense(4)
            self.head = layers.Dense(1)

        def call(self, x):
            # Raw TensorFlow: the backbone's output must keep the dtype of
            # the 16-bit tensor it is joined with.
            return self.head(tf.concat([self.backbone(x), self.meta(x)], -1))

    model = FineTune()
    model(np.ones((2, 4)))  # built while the backbone's output was 16-bit
    kmp.compile(backbone, optimizer="sgd", loss="mse")  # its output: float32
    kmp.compile(model, optimizer="sgd", loss="mse")
    # FineTune.call cannot be traced with it in float32: back to 16-bit.
    assert backbone.get_layer("features").compute_dtype == "bfloat16"
    history = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0).history
    assert np.isfinite(history["loss"][0])


class JoinsInItsTrainStep(keras.Model):
    """No call: its train_step joins a held model's output with a 16-bit
    layer's output in raw TensorFlow (a conditional GAN's pattern)."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential(
            [keras.Input((4,)), layers.Dense(4)], name="encoder"
        )
        self.label_embedding = layers.Dense(4)
        self.head = keras.Sequential([keras.Input((8,)), layers.Dense(1)], name="head")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            h = tf.concat([self.encoder(x), self.label_embedding(x)], -1)
            prediction = tf.cast(self.head(h), "float32")
            loss = tf.reduce_mean(tf.square(prediction - y))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("built", [True, False], ids=["built", "unbuilt"])
def test_a_train_step_that_mixes_a_float32_output_says_how_to_keep_it_16bit(built):
    kmp.set_policy("mixed_bfloat16")
    model = JoinsInItsTrainStep()
    if built:
        model.label_embedding.build((None, 4))
    kmp.compile(model, optimizer="sgd")
    assert model.encoder.layers[-1].compute_dtype == "float32"
    x, y = np.ones((8, 4)), np.ones((8, 1))
    # kmp cannot read a train_step: the error names the rule, no retry.
    path = "encoder/" + model.encoder.layers[-1].name
    rule = f"kmp.set_layer_policy('name:{path}', 'mixed_bfloat16')"
    with pytest.raises(TypeError, match=re.escape(rule)):
        model.fit(x, y, verbose=0)
    assert model.encoder.layers[-1].compute_dtype == "float32"  # nothing undone
    kmp.set_layer_policy(f"name:{path}", "mixed_bfloat16")
    try:
        if not built:  # its layers first built in the failed step: anew
            model = JoinsInItsTrainStep()
            path = "encoder/" + model.encoder.layers[-1].name
            kmp.clear_layer_policies()
            kmp.set_layer_policy(f"name:{path}", "mixed_bfloat16")
        kmp.compile(model, optimizer="sgd")
        history = model.fit(x, y, verbose=0).history
    finally:
        kmp.clear_layer_policies()
    assert np.isfinite(history["loss"][0])
    assert model.encoder.layers[-1].compute_dtype == "bfloat16"  # as Keras


def test_a_reloaded_model_with_its_own_logs_gets_the_telemetry_from_attach(tmp_path):
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = OwnLogs(inputs, layers.Dense(1)(layers.Dense(8)(inputs)))
    kmp.compile(model, optimizer="sgd", loss="mse")
    x, y = np.ones((16, 4)), np.ones((16, 1))
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(tmp_path / "own_logs.keras")
    loaded = keras.models.load_model(
        tmp_path / "own_logs.keras", custom_objects={"OwnLogs": OwnLogs}
    )
    assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer)
    kmp.telemetry.attach(loaded)
    logs = loaded.fit(x, y, batch_size=4, verbose=0).history
    assert logs["loss_scale"] == [32768.0]
    assert logs["skipped_steps"] == [0.0] and logs["skipped_steps_total"] == [0.0]
