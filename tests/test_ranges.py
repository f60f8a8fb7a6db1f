"""The activation range check: the layers whose activations on a sample
reach float16's limit, named before training (`kmp.debug.precision_audit(
model, sample=...)`, `kmp.compile(..., sample=...)`, `kmp doctor --model
FILE`), measured in float32."""

import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp.backend import ranges


def ffn_model(up_scale: float = 1.0) -> keras.Model:
    """Dense up, Dense down: with `up_scale`, the up projection's output
    overflows float16 while the block's output stays in range, as with
    weights pretrained in bfloat16."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    y = keras.layers.Dense(16, name="down")(h)
    outputs = keras.layers.Dense(4, name="head")(y)
    model = keras.Model(inputs, outputs, name="ffn")
    up = model.get_layer("up")
    up.kernel.assign(up.kernel * up_scale)
    down = model.get_layer("down")
    down.kernel.assign(down.kernel / up_scale)
    return model


def sample(n: int = 8) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, 16)).astype("float32") * 4


def test_audit_names_the_layer_that_overflows_float16_on_a_sample():
    kmp.set_policy("mixed_float16")
    model = ffn_model(up_scale=1e4)
    assert "float16 overflow" not in kmp.debug.precision_audit(model).kinds()
    report = kmp.debug.precision_audit(model, sample=sample())
    (risk,) = [r for r in report if r.kind == "float16 overflow"]
    assert risk.layer == "up" and risk.class_name == "Dense"
    assert "65504" in risk.detail and "'name:up'" in risk.fix
    assert "mixed_bfloat16" in risk.fix
    # The block's output is in range: "down" is not named.
    assert not any(r.layer == "down" and "float16" in r.kind for r in report)
    # The pass ran in float32 and put every policy back.
    assert {layer.compute_dtype for layer in model.layers[1:]} == {"float16"}
    # Without the overflow, nothing is named.
    clean = kmp.debug.precision_audit(ffn_model(), sample=sample())
    assert not {"float16 overflow", "near float16's range"} & clean.kinds()


def test_a_bfloat16_run_is_never_told_of_float16_overflow_nor_to_use_bfloat16():
    # bfloat16 has float32's range: the activations that overflow float16
    # are no risk to it, and "train in bfloat16" is no advice to give it.
    kmp.set_policy("mixed_bfloat16")
    model = ffn_model(up_scale=1e4)
    report = kmp.debug.precision_audit(model, sample=sample())
    assert not {"float16 overflow", "near float16's range"} & report.kinds()
    assert not any("mixed_bfloat16" in r.fix for r in report)
    # The same model audited under float16 is told.
    assert (
        "float16 overflow"
        in kmp.debug.precision_audit(
            model, policy="mixed_float16", sample=sample()
        ).kinds()
    )


def test_audit_names_layers_near_the_limit_within_the_headroom():
    kmp.set_policy("mixed_float16")
    model = ffn_model()
    measured = ranges.activation_ranges(model, sample())
    peak = max(measured.layers, key=lambda r: r.max_abs)
    # Scale the sample so that the largest activation sits at 0.4x the limit:
    # named with headroom 4, not with the default 2.
    x = sample() * (0.4 * 65504 / peak.max_abs)
    assert (
        "near float16's range" not in kmp.debug.precision_audit(model, sample=x).kinds()
    )
    report = kmp.debug.precision_audit(model, sample=x, headroom=4)
    assert ("near float16's range", peak.path) in {(r.kind, r.layer) for r in report}


def test_attention_masks_are_not_taken_for_overflow():
    # A causal mask adds -1e9 to the scores in float32 (and a float16-safe
    # value in float16): scores and masks flowing into a softmax are left out.
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((8, 16))
    y = keras.layers.MultiHeadAttention(2, 8, name="mha")(
        inputs, inputs, use_causal_mask=True
    )
    model = keras.Model(inputs, y)
    x = np.random.default_rng(0).normal(size=(2, 8, 16)).astype("float32")
    measured = ranges.activation_ranges(model, x)
    assert measured.layers and max(r.max_abs for r in measured.layers) < 1e3
    assert "float16 overflow" not in kmp.debug.precision_audit(model, sample=x).kinds()


def test_a_keras_hub_backbone_on_token_ids_and_an_overflowing_feed_forward():
    keras_hub = pytest.importorskip("keras_hub")
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )
    x = {
        "token_ids": np.random.default_rng(0).integers(0, 64, (2, 16)),
        "padding_mask": np.ones((2, 16), "int32"),
    }
    report = kmp.debug.precision_audit(backbone, sample=x)
    assert not report.not_traced
    assert not {"float16 overflow", "near float16's range"} & report.kinds()
    ffn = backbone.get_layer("transformer_layer_1")._feedforward_intermediate_dense
    ffn.kernel.assign(ffn.kernel * 1e5)
    over = [
        r.layer for r in kmp.debug.precision_audit(backbone, sample=x)
        if r.kind == "float16 overflow"
    ]  # fmt: skip
    # In forward order: the scaled layer first, then what its output reaches.
    assert over[0] == f"transformer_layer_1/{ffn.name}", over
    assert not any(layer.startswith("transformer_layer_0") for layer in over)


def test_a_subclassed_model_with_raw_tensorflow_ops_is_attributed_by_layer():
    import tensorflow as tf

    class Boost(keras.layers.Layer):
        def call(self, x):
            return tf.math.exp(x)  # raw TensorFlow

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(8, name="dense")
            self.boost = Boost(name="boost")
            self.out = keras.layers.Dense(2, name="out")

        def call(self, x):
            return self.out(self.boost(self.dense(x)))

    kmp.set_policy("mixed_float16")
    model = Net()
    x = np.full((2, 4), 3.0, "float32")
    model(x)
    model.dense.kernel.assign(np.full((4, 8), 1.0))  # exp(12) = 1.6e5
    kinds = {(r.layer, r.kind) for r in kmp.debug.precision_audit(model, sample=x)}
    assert ("boost", "float16 overflow") in kinds
    assert not any(layer == "dense" for layer, _ in kinds)


def test_compile_with_a_sample_builds_an_unbuilt_subclassed_model_first():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.up = keras.layers.Dense(8, kernel_initializer="ones", name="up")
            self.out = keras.layers.Dense(2, name="out")

        def call(self, x):
            return self.out(self.up(x))

    kmp.set_policy("mixed_float16")
    model = Net()
    with pytest.warns(UserWarning, match=r"float16's largest value .*'up'"):
        kmp.compile(model, optimizer="adam", loss="mse", sample=np.full((2, 4), 2e4))
    assert model.up.compute_dtype == "float16"


def test_audit_refuses_a_batch_as_policy_and_a_headroom_below_one():
    model = ffn_model()
    with pytest.raises(TypeError, match="sample=batch"):
        kmp.debug.precision_audit(model, sample())
    with pytest.raises(ValueError, match="at least 1"):
        kmp.debug.precision_audit(model, sample=sample(), headroom=0.5)
    report = kmp.debug.precision_audit(model, sample=np.ones((2, 3), "float32"))
    assert "could not run on the sample" in str(report)


def test_compile_with_a_sample_warns_about_float16_overflow_only_in_float16():
    kmp.set_policy("mixed_float16")
    model = ffn_model(up_scale=1e4)
    with pytest.warns(UserWarning, match=r"float16's largest value .*'up' \("):
        kmp.compile(model, optimizer="adam", loss="mse", sample=sample())
    kmp.set_policy("mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kmp.compile(ffn_model(1e4), optimizer="adam", loss="mse", sample=sample())
    kmp.set_policy("mixed_float16")
    with pytest.raises(ValueError, match="could not"):
        kmp.compile(ffn_model(), optimizer="adam", loss="mse", sample=np.ones((2, 3)))


def test_doctor_names_an_overflowing_layer_of_a_saved_model(tmp_path, capsys):
    import json

    import kmp_cli

    kmp.set_policy("float32")
    path = str(tmp_path / "ffn.keras")
    ffn_model(up_scale=1e4).save(path)
    np.save(tmp_path / "x.npy", sample())
    argv = ["doctor", "--model", path, "--policies", "float32"]
    assert kmp_cli.main([*argv, "--sample", str(tmp_path / "x.npy"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["activation_range"]
    assert [(r["layer"], r["kind"]) for r in found] == [("up", "float16 overflow")]
    assert kmp_cli.main(argv) == 0  # random inputs, said so
    out = capsys.readouterr().out
    assert "random inputs" in out and "activation range and precision of" in out
    assert kmp_cli.main([*argv, "--sample", str(tmp_path / "x.csv")]) != 0
    assert "--sample must be" in capsys.readouterr().err


def test_what_the_model_computes_in_float32_is_not_named():
    # A LayerNormalization under mixed_float16 computes in float32 inside:
    # its variance of inputs near 1e3 reaches 1e6 there, and cannot overflow
    # float16; nor can the head kmp computes in float32. A Dense whose own
    # output reaches 1e5 in float16 is named.
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, name="wide")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(64, name="big")(h)
    head = keras.layers.Dense(4, activation="sigmoid", name="head")
    model = kmp.prepare(keras.Model(inputs, head(h)))
    assert model.get_layer("head").compute_dtype == "float32"
    wide, big = model.get_layer("wide"), model.get_layer("big")
    wide.kernel.assign(wide.kernel * 300)  # |x| ~ 1e3 at the norm's input
    big.kernel.assign(big.kernel * 5e4)  # its output passes 65504
    x = sample(32)
    assert np.abs(keras.Model(inputs, model.get_layer("wide").output)(x)).max() > 1e3
    named = {
        r.layer
        for r in kmp.debug.precision_audit(model, sample=x).risks
        if r.kind in ("float16 overflow", "near float16's range")
    }
    assert named == {"big"}
    # Counting every op (what float16 would meet in each) names them all.
    every = ranges.activation_ranges(model, x).above(65504.0)
    assert {"norm", "head", "big"} <= {r.path for r in every}


class AddsFloat32(keras.layers.Layer):
    """Adds a float32 constant in raw TensorFlow: runs in float32, fails
    under float16 (mixed dtypes)."""

    def call(self, x):
        import tensorflow as tf

        return tf.add(x, tf.constant(1.0, "float32"))


def test_a_model_that_cannot_trace_in_16_bit_still_has_its_ranges_checked():
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, name="big")(inputs)
    h = AddsFloat32(name="adds", dtype="float32")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    big = model.get_layer("big")
    big.kernel.assign(big.kernel * 5e4)
    # Built in float32; in float16 its raw add fails on mixed dtypes, so the
    # model cannot be traced under its own policies. The range pass, in
    # float32, runs: every op is counted, and that is said.
    model.get_layer("adds").dtype_policy = "mixed_float16"
    report = kmp.debug.precision_audit(model, sample=sample(32))
    named = {r.layer: r for r in report if r.kind == "float16 overflow"}
    assert "big" in named
    assert "every op counted" in named["big"].detail
    assert "AddV2" in named["big"].detail
    # The layer's own dtype error names the mismatch, not its arguments.
    (error,) = [r for r in report if r.layer == "adds" and r.kind == "dtype error"]
    assert "half tensor but is a float tensor" in error.detail
