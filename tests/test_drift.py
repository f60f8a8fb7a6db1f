"""Precision, not only range: a layer whose 16-bit results move far beyond
rounding is named, with the fix that works, by the audit, kmp.compile and
kmp doctor; real models are not."""

import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp.backend import drift


@keras.saving.register_keras_serializable(package="kmp_tests")
class SensorStd(keras.layers.Layer):
    """Typical sensor code: the standard deviation of temperatures near
    300 K, as sqrt(E[x²] - E[x]²)."""

    def call(self, x):
        m = keras.ops.mean(x, axis=-1, keepdims=True)
        m2 = keras.ops.mean(x * x, axis=-1, keepdims=True)
        return keras.ops.sqrt(keras.ops.maximum(m2 - m * m, 0.0))


def sensor_data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.uniform(290, 310, size=(n, 1))
    spread = rng.uniform(0.1, 1.0, size=(n, 1))
    x = (base + spread * rng.standard_normal((n, 16))).astype("float32")
    return x, (3 * x.std(axis=1, keepdims=True)).astype("float32")


def sensor_model():
    inputs = keras.Input((16,))
    h = SensorStd(name="pool")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(h))


def final_loss(model, x, y):
    keras.utils.set_random_seed(0)
    kmp.compile(model, optimizer=keras.optimizers.Adam(0.05), loss="mse")
    history = model.fit(x, y, epochs=20, batch_size=32, verbose=0, shuffle=False)
    return history.history["loss"][-1]


def test_the_audit_names_a_layer_whose_inputs_are_rounded_at_its_boundary():
    kmp.set_policy("mixed_bfloat16")
    x, _ = sensor_data(64)
    report = kmp.debug.precision_audit(kmp.prepare(sensor_model()), sample=x)
    [risk] = [r for r in report if r.kind == "bfloat16 precision"]
    assert risk.layer == "pool"
    assert "rounds its float32 inputs to bfloat16" in risk.detail
    assert "kmp.set_layer_policy('name:pool', 'float32')" in risk.fix
    assert "comes too late" in risk.fix
    # Never bfloat16 advice to a bfloat16 run.
    assert not any("bfloat16" in r.fix for r in report)


class SensorStdSliced(keras.layers.Layer):
    """The same, on the first 16 features of a rank-3 input, its result
    handed on through a slice: data movement at both ends."""

    def call(self, x):
        x = x[..., :16]
        m = keras.ops.mean(x, axis=-1, keepdims=True)
        m2 = keras.ops.mean(x * x, axis=-1, keepdims=True)
        return keras.ops.sqrt(keras.ops.maximum(m2 - m * m, 0.0))[..., 0]


def test_a_layer_with_data_movement_at_its_edges_is_named_and_no_other():
    kmp.set_policy("mixed_bfloat16")
    x, _ = sensor_data(64)
    inputs = keras.Input((4, 20))
    h = SensorStdSliced(name="pool")(inputs)
    h = keras.layers.Dense(8, name="mix")(h)
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(1)(h)))
    batch = np.concatenate([x.reshape(64, 4, 4)] * 5, axis=-1)[:, :, :20]
    named = kmp.debug.precision_audit(model, sample=batch)
    [risk] = [r for r in named if "precision" in r.kind]
    assert risk.layer == "pool" and "rounds its float32 inputs" in risk.detail


class Sampling(keras.layers.Layer):
    """keras-io's VAE sampling layer (its noise in the input's dtype):
    random draws, different in each pass."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        mean, log_var = inputs
        noise = keras.random.normal(
            keras.ops.shape(mean), dtype=mean.dtype, seed=self.seed_generator
        )
        return mean + keras.ops.exp(0.5 * log_var) * noise


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_random_draws_are_not_named_and_the_seed_is_left_as_it_was(policy):
    kmp.set_policy(policy)
    inputs = keras.Input((8,))
    mean = keras.layers.Dense(2)(inputs)
    log_var = keras.layers.Dense(2)(inputs)
    z = Sampling(name="sampling")([mean, log_var])
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(8)(z)))
    state = model.get_layer("sampling").seed_generator.state
    before = keras.ops.convert_to_numpy(state)
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    measured = drift.layer_drift(model, x)
    assert measured.error == "" and measured.beyond_rounding() == []
    assert "sampling" not in {d.path for d in measured.layers}
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(state), before)


def test_the_fix_the_audit_gives_trains_as_float32_does():
    x, y = sensor_data()
    kmp.set_policy("float32")
    reference = final_loss(sensor_model(), x, y)
    kmp.set_policy("mixed_bfloat16")
    rounded = final_loss(sensor_model(), x, y)
    kmp.set_layer_policy("name:pool", "float32")
    try:
        fixed_model = kmp.prepare(sensor_model())
        assert kmp.debug.precision_audit(fixed_model, sample=x[:64]).kinds() == set()
        fixed = final_loss(fixed_model, x, y)
    finally:
        kmp.clear_layer_policies()
    # Against the targets' variance (what predicting their mean scores):
    # rounded to bfloat16 the layer learns nothing; fixed, it learns as
    # float32 does.
    variance = float(y.var())
    assert rounded > 0.5 * variance
    assert fixed < 0.05 * variance and reference < 0.05 * variance


def test_float16_overflow_advice_leaves_out_bfloat16_where_it_loses_precision():
    kmp.set_policy("mixed_float16")
    x, _ = sensor_data(64)
    report = kmp.debug.precision_audit(kmp.prepare(sensor_model()), sample=x)
    [risk] = [r for r in report if r.kind == "float16 overflow"]
    assert risk.layer == "pool"
    assert "train in bfloat16" not in risk.fix
    assert "kmp.set_layer_policy('name:pool', 'float32')" in risk.fix

    # A layer that only overflows is offered bfloat16.
    inputs = keras.Input((4,))
    big = keras.layers.Dense(4, name="big", kernel_initializer="ones")(inputs)
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(1)(big)))
    report = kmp.debug.precision_audit(model, sample=np.full((8, 4), 3e4, "float32"))
    [risk] = [r for r in report if r.kind == "float16 overflow" and r.layer == "big"]
    assert risk.fix.startswith("train in bfloat16")


class ExactSpread(keras.layers.Layer):
    def call(self, x):
        mean = keras.ops.mean(x, -1, keepdims=True)
        return keras.ops.mean(x * x, -1, keepdims=True) - mean * mean


def test_cancellation_on_exact_inputs_is_fixed_by_a_float32_scope():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(
        keras.Sequential(
            [keras.Input((4,)), ExactSpread(name="spread"), keras.layers.Dense(1)]
        )
    )
    x = np.tile(np.array([[300.0, 302.0, 300.0, 302.0]], "float32"), (8, 1))
    [risk] = [
        r for r in kmp.debug.precision_audit(model, sample=x) if "precision" in r.kind
    ]
    assert risk.layer == "spread" and "cancels" in risk.detail
    assert "@kmp.float32_scope" in risk.fix

    class ScopedSpread(keras.layers.Layer):
        @kmp.float32_scope
        def call(self, x):
            mean = keras.ops.mean(x, -1, keepdims=True)
            return keras.ops.mean(x * x, -1, keepdims=True) - mean * mean

    fixed = kmp.prepare(
        keras.Sequential(
            [keras.Input((4,)), ScopedSpread(name="spread"), keras.layers.Dense(1)]
        )
    )
    assert drift.layer_drift(fixed, x).beyond_rounding() == []


def test_a_layer_fed_rounded_results_names_the_layers_that_feed_it():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((16,))
    shift = keras.layers.Dense(
        16,
        name="shift",
        kernel_initializer="identity",
        bias_initializer=keras.initializers.Constant(300.0),
    )(inputs)
    model = kmp.prepare(
        keras.Model(inputs, keras.layers.Dense(1)(SensorStd(name="pool")(shift)))
    )
    x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32") * 0.5
    [risk] = [
        r for r in kmp.debug.precision_audit(model, sample=x) if "precision" in r.kind
    ]
    assert risk.layer == "pool" and "'shift'" in risk.detail
    assert "name:shift" in risk.fix and "name:pool" in risk.fix


def test_compile_with_a_sample_warns_about_lost_precision():
    kmp.set_policy("mixed_bfloat16")
    x, _ = sensor_data(64)
    with pytest.warns(UserWarning, match=r"'pool'.*name:pool', 'float32'"):
        kmp.compile(sensor_model(), optimizer="adam", loss="mse", sample=x)
    kmp.set_policy("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kmp.compile(sensor_model(), optimizer="adam", loss="mse", sample=x)


def small_cnn():
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Conv2D(16, 3, padding="same"),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.DepthwiseConv2D(3, padding="same"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    ), np.random.default_rng(0).uniform(0, 255, (8, 32, 32, 3)).astype("float32")


def transformer():
    inputs = keras.Input((16,), dtype="int32")
    h = keras.layers.Embedding(500, 32)(inputs)
    a = keras.layers.MultiHeadAttention(4, 8)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(64, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(32)(f))
    model = keras.Model(inputs, keras.layers.Dense(500)(h))
    return model, np.random.default_rng(0).integers(0, 500, (8, 16))


def gpt2():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=128,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=32,
    )
    x = {
        "token_ids": np.random.default_rng(0).integers(0, 128, (2, 32)),
        "padding_mask": np.ones((2, 32), "int32"),
    }
    return backbone, x


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("build", [small_cnn, transformer, gpt2])
def test_models_without_a_precision_problem_are_not_named(build, policy):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    model, x = build()
    measured = drift.layer_drift(kmp.prepare(model), x)
    assert measured.error == "" and len(measured.layers) > 3
    assert measured.beyond_rounding() == []
    # Far from the line: each layer within half of what names one.
    floor = drift.ROUNDING_UNITS * drift.EPSILON[measured.dtype]
    assert all(
        d.error < 0.5 * max(floor, drift.AMPLIFICATION * d.input_error)
        for d in measured.layers
    )


def test_a_float32_model_has_nothing_to_compare():
    kmp.set_policy("float32")
    x, _ = sensor_data(8)
    measured = drift.layer_drift(sensor_model(), x)
    assert measured.layers == () and measured.dtype == ""


def test_doctor_checks_a_saved_models_precision_under_the_auto_policy(
    tmp_path, capsys, monkeypatch
):
    import json

    import kmp_cli
    from kmp.backend import machine
    from kmp.precision import auto

    monkeypatch.setattr(
        machine, "resolve_auto", lambda: auto.AutoChoice("mixed_bfloat16", "a fake")
    )
    kmp.set_policy("float32")
    path = str(tmp_path / "sensor.keras")
    sensor_model().save(path)
    x, _ = sensor_data(64)
    np.save(tmp_path / "x.npy", x)
    argv = ["doctor", "--model", path, "--policies", "float32"]
    assert kmp_cli.main([*argv, "--sample", str(tmp_path / "x.npy"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["activation_range"]
    [risk] = [r for r in found if r["kind"] == "bfloat16 precision"]
    assert risk["layer"] == "pool" and "name:pool', 'float32'" in risk["fix"]
    assert kmp_cli.main([*argv, "--sample", str(tmp_path / "x.npy")]) == 0
    assert "fix (bfloat16 precision): compute it in float32" in capsys.readouterr().out
