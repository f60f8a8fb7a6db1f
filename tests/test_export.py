"""kmp.export: a trained model written for 16-bit inference, with 16-bit
weights where the plan computes in 16 bits and float32 ones where it keeps
float32, and no optimizer. Loaded by plain Keras in test_saving.py."""

import json
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

# One rounding of a value near one, and what a few of them add up to.
ROUNDING = {"bfloat16": 2**-8, "float16": 2**-11}


def tabular(keep: str | None = None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    h = keras.layers.BatchNormalization(name="batch_norm")(h)
    h = keras.layers.Dense(16, activation="relu", name="keep")(h)
    h = keras.layers.LayerNormalization(name="layer_norm")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, x[:, :3] * 2.0


def dtypes(model) -> dict[str, str]:
    return {weight.path: weight.dtype for weight in model.weights}


def test_a_bfloat16_export_holds_16bit_weights_and_predicts_as_trained(tmp_path):
    kmp.set_policy("mixed_bfloat16")
    kmp.set_layer_policy("name:keep", "float32")
    model = kmp.compile(tabular(), optimizer="adam", loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    path = tmp_path / "model.keras"
    exported = kmp.export(model, path)

    want = {
        path: "float32" if path.startswith("keep/") else "bfloat16"
        for path in dtypes(model)
    }
    assert dtypes(exported) == want
    assert set(dtypes(model).values()) == {"float32"}  # the trained model's
    with zipfile.ZipFile(path) as saved:
        assert not json.loads(saved.read("config.json")).get("compile_config")
    loaded = keras.models.load_model(path)
    assert dtypes(loaded) == want and not loaded.compiled
    expected = model.predict(x, verbose=0)
    predicted = exported.predict(x, verbose=0)
    assert predicted.dtype == np.float32
    # bfloat16 weights: each weight rounded once, the activations as before.
    # Normalizations magnify their bfloat16-rounded weights' flips (measured
    # up to 1.9x the error of one rounding per layer over 90 seeds).
    np.testing.assert_allclose(predicted, expected, rtol=2**-4, atol=0.06)
    np.testing.assert_allclose(
        np.asarray(loaded.predict(x, verbose=0), "float32"),
        predicted,
        rtol=2**-8,
        atol=1e-6,
    )


def attention_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(inputs, inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def test_a_float16_export_keeps_the_float32_attention_scores(tmp_path):
    """A model trained in float16 needs no sample: its 16-bit layers
    computed in float16 already."""
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(attention_model())
    exported = kmp.export(model, tmp_path / "model.keras", "float16")
    attention = exported.get_layer("attention")
    assert attention.query_dense.kernel.dtype == "float32"
    assert attention.key_dense.kernel.dtype == "float32"
    assert attention.value_dense.kernel.dtype == "float16"
    assert exported.get_layer("head").kernel.dtype == "float16"
    x = np.random.default_rng(1).normal(size=(2, 4, 8)).astype("float32")
    np.testing.assert_allclose(
        exported.predict(x, verbose=0),
        model.predict(x, verbose=0),
        rtol=8 * ROUNDING["float16"],
        atol=1e-3,
    )


def test_a_float16_export_is_refused_where_values_pass_its_range(tmp_path):
    kmp.set_policy("mixed_bfloat16")
    model = tabular()
    up = model.get_layer("up")
    up.kernel.assign(up.kernel * 1e5)  # as bfloat16-trained weights can be
    path = tmp_path / "model.keras"
    with pytest.raises(ValueError, match=r"Pass sample=<a batch of inputs>"):
        kmp.export(model, path, "float16")
    x, _ = data(8)
    with pytest.raises(ValueError, match=r"in 'up' \(\S+ reaches \d"):
        kmp.export(model, path, "float16", sample=x)
    assert not path.exists()
    kmp.export(model, path, "bfloat16")  # bfloat16's range holds them
    assert path.exists()

    up.kernel.assign(up.kernel / 1e5)
    head = model.get_layer("head")
    head.bias.assign([1e5, 0.0, 0.0])  # beyond float16 as a weight
    with pytest.raises(ValueError, match=r"'head/bias'"):
        kmp.export(model, path, "float16", sample=x)


@keras.saving.register_keras_serializable("kmp_tests")
class Misdescribed(keras.layers.Dense):
    """A layer whose config does not describe it."""

    def get_config(self):
        return {**super().get_config(), "units": self.units + 1}


def test_export_refuses_what_it_cannot_write(tmp_path):
    kmp.set_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match=r"dtype must be 'bfloat16' or 'float16'"):
        kmp.export(tabular(), tmp_path / "m.keras", "float32")
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="is not built"):
        kmp.export(unbuilt, tmp_path / "m.keras")
    with pytest.raises(TypeError, match="expects a Keras model"):
        kmp.export(keras.layers.Dense(2), tmp_path / "m.keras")
    kmp.set_policy("float32")
    with pytest.raises(ValueError, match=r"no layer of .* does .*policy is float32"):
        kmp.export(tabular(), tmp_path / "m.keras")
    kmp.set_policy("mixed_bfloat16")
    misdescribed = keras.Sequential([keras.Input((3,)), Misdescribed(2, name="m")])
    with pytest.raises(
        ValueError,
        match=r"2 against 2, first \S*m/kernel \(3, 2\) rebuilt as m/kernel \(3, 3\)",
    ):
        kmp.export(misdescribed, tmp_path / "m.keras")
    assert not (tmp_path / "m.keras").exists()


def test_a_path_without_keras_suffix_gets_a_saved_model_tensorflow_serves(tmp_path):
    kmp.set_policy("mixed_bfloat16")
    model = tabular()
    x, _ = data(4)
    kmp.export(model, tmp_path / "served")
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(
        np.asarray(tf.cast(served.serve(x), "float32")),
        model.predict(x, verbose=0),
        rtol=8 * ROUNDING["bfloat16"],
        atol=0.02,
    )


def test_kmp_layers_are_exported_as_the_keras_layers_they_extend(tmp_path):
    """kmp.layers.lean's layers keep less for the backward pass; the export,
    for inference, holds Keras's own classes, which plain Keras loads."""
    kmp.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    h = keras.layers.LayerNormalization(name="norm")(inputs)
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
    model = kmp.layers.lean(keras.Model(inputs, keras.layers.Dense(3)(h)))
    assert type(model.get_layer("norm")) is kmp.layers.LayerNormalization
    path = tmp_path / "model.keras"
    exported = kmp.export(model, path)
    with zipfile.ZipFile(path) as saved:
        assert "kmp" not in saved.read("config.json").decode()
    assert type(exported.get_layer("norm")) is keras.layers.LayerNormalization
    assert type(exported.get_layer("attention")) is keras.layers.MultiHeadAttention
    x = np.random.default_rng(2).normal(size=(2, 4, 8)).astype("float32")
    np.testing.assert_allclose(
        exported.predict(x, verbose=0),
        model.predict(x, verbose=0),
        rtol=8 * ROUNDING["bfloat16"],
        atol=0.02,
    )


def test_a_convolution_in_float32_for_cpu_speed_alone_is_exported_16bit(tmp_path):
    """kmp computes float16 convolutions in float32 on a CPU, for speed: the
    export, for wherever it is served, computes them in float16. Their
    activations were float32 in training, so a sample checks their range."""
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(2, name="head")(h)))
    assert model.get_layer("conv").compute_dtype == "float32"  # no GPU here
    path = tmp_path / "model.keras"
    with pytest.raises(ValueError, match="1 layer computed in float32 on this"):
        kmp.export(model, path, "float16")
    x = np.random.default_rng(3).normal(size=(2, 8, 8, 3)).astype("float32")
    exported = kmp.export(model, path, "float16", sample=x)
    assert exported.get_layer("conv").kernel.dtype == "float16"
    np.testing.assert_allclose(
        exported.predict(x, verbose=0),
        model.predict(x, verbose=0),
        rtol=8 * ROUNDING["float16"],
        atol=1e-3,
    )


def test_layers_of_the_same_name_in_two_inner_models_are_told_apart(tmp_path):
    """The float32-for-CPU-speed convolution 'proj' of one inner model goes
    16-bit; the Dense 'proj' of another, float32 by a rule, stays float32."""
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("name:enc_b/proj", "float32")
    keras.utils.set_random_seed(0)
    images = keras.Input((8, 8, 3))
    conv = keras.layers.Conv2D(4, 3, name="proj")(images)
    enc_a = keras.Model(
        images, keras.layers.GlobalAveragePooling2D()(conv), name="enc_a"
    )
    features = keras.Input((4,))
    enc_b = keras.Model(
        features, keras.layers.Dense(4, name="proj")(features), name="enc_b"
    )
    model = kmp.prepare(keras.Model(images, enc_b(enc_a(images))))
    x = np.random.default_rng(4).normal(size=(2, 8, 8, 3)).astype("float32")
    exported = kmp.export(model, tmp_path / "m.keras", "float16", sample=x)
    assert exported.get_layer("enc_a").get_layer("proj").kernel.dtype == "float16"
    assert exported.get_layer("enc_b").get_layer("proj").kernel.dtype == "float32"
