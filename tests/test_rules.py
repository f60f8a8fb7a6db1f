"""kmp.rules: user rules and selectors, the defaults table, registration of
third-party classes, and the attention scores modes."""

import warnings

import keras
import numpy as np
import pytest
from tolerances import RELATIVE
from tolerances import relative_error

import kmp
from kmp.precision import attention
from kmp.precision import kinds
from kmp.precision import rules


@pytest.mark.parametrize(
    "selector, error, message",
    [
        ("Dense", ValueError, "'name:<glob>'"),
        ("layer:x", ValueError, "'class:<glob>'"),
        ("name:", ValueError, "Invalid selector"),
        (int, TypeError, "subclass of keras.layers.Layer"),
        (3, TypeError, "Received: 3"),
    ],
)
def test_bad_selectors_are_rejected_with_the_fix(selector, error, message):
    with pytest.raises(error, match=message):
        kmp.set_layer_policy(selector, "float32")


def test_set_layer_policy_rejects_unknown_policies():
    with pytest.raises(kmp.PolicyError, match="Unknown policy 'fp8'"):
        kmp.set_layer_policy("name:x", "fp8")


def test_set_layer_policy_replaces_and_removes_rules():
    kmp.set_layer_policy("name:x", "float32")
    kmp.set_layer_policy("name:x", "mixed_bfloat16")
    assert [r.policy.name for r in rules.layer_rules()] == ["mixed_bfloat16"]
    kmp.set_layer_policy("name:x", None)
    assert rules.layer_rules() == []


def test_a_class_pattern_that_matches_no_class_warns_with_the_closest_names():
    with pytest.warns(
        UserWarning, match=r"class:Konv2D.*Closest class names: .*Conv2D"
    ):
        kmp.set_layer_policy("class:Konv2D", "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kmp.set_layer_policy("class:Conv*", "float32")  # matches: no warning


def test_prepare_warns_about_a_rule_that_matches_no_layer_of_the_model():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("name:hed", "float32")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="head"), keras.layers.ReLU()]
    )
    with pytest.warns(UserWarning, match=r"name:hed matches no layer.*head"):
        kmp.prepare(model)


def test_every_default_names_a_class_that_exists_in_the_installed_libraries():
    import importlib

    for entry in kinds.DEFAULTS:
        module, _, name = entry.qualname.rpartition(".")
        assert hasattr(importlib.import_module(module), name), entry.qualname


def test_register_layer_class_makes_kmp_treat_a_class_as_its_kind():
    class FancyNorm(keras.layers.Layer):
        def call(self, x):
            x32 = keras.ops.cast(x, "float32")
            y = x32 / keras.ops.sqrt(keras.ops.mean(x32 * x32, -1, keepdims=True))
            return keras.ops.cast(y, self.compute_dtype)

    class FancySoftmax(keras.layers.Layer):
        def call(self, x):
            return keras.ops.softmax(x)

    kmp.rules.register_layer_class(
        FancyNorm, "normalization_float32_inside", source="mylib"
    )
    kmp.rules.register_layer_class(
        f"{FancySoftmax.__module__}.{FancySoftmax.__qualname__}", "softmax"
    )
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            FancyNorm(name="norm"),
            FancySoftmax(name="probs"),
            keras.layers.Dense(2),
        ]
    )
    kmp.prepare(model)
    report = kmp.precision_report(model)
    assert report.row("norm").inside == "float32 inside (mylib)"
    assert report.row("norm").compute_dtype == "bfloat16"
    assert report.row("probs").compute_dtype == "float32"
    assert report.row("probs").kind == "softmax"
    kinds._clear_registrations()
    assert kmp.precision_report(model).row("norm").inside.startswith("float32 inside:")


def test_register_layer_class_rejects_bad_input():
    with pytest.raises(TypeError, match="Layer subclass"):
        kmp.rules.register_layer_class(int, "softmax")
    with pytest.raises(TypeError, match="qualified name"):
        kmp.rules.register_layer_class("FancyNorm", "softmax")
    with pytest.raises(ValueError, match=r"'softmax'.*Received: 'soft_max'"):
        kmp.rules.register_layer_class(keras.layers.Dense, "soft_max")
    with pytest.raises(ValueError, match=r"Received: \[.softmax.\]"):
        kmp.rules.register_layer_class(keras.layers.Dense, ["softmax"])


def test_a_registration_replaces_a_default_for_its_class():
    kmp.rules.register_layer_class(keras.layers.Softmax, "attention_own_code")
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(
        keras.Sequential(
            [keras.Input((4,)), keras.layers.Softmax(), keras.layers.ReLU()]
        )
    )
    assert model.layers[0].compute_dtype == "float16"  # KEEP, by registration


def test_the_module_docstring_states_the_resolution_order():
    doc = rules.__doc__
    order = [
        doc.index(s)
        for s in (
            "explicit `dtype=`",
            "layer-name rule",
            "class rule",
            "kmp's defaults",
            "enclosing layer",
        )
    ]
    assert order == sorted(order)


def test_attention_scores_modes_are_validated():
    with pytest.raises(ValueError, match="'auto', 'float32', 'compute'"):
        attention.set_attention_scores("fast")
    assert attention.attention_scores("float16") == "float32"
    assert attention.attention_scores("bfloat16") == "compute"
    attention.set_attention_scores("float32")
    assert attention.attention_scores("bfloat16") == "float32"
    attention.set_attention_scores("compute")
    assert attention.attention_scores("float16") == "compute"


# --- attention numerics ---------------------------------------------------------


def _float32_mha(dropout, x):
    keras.config.set_dtype_policy("float32")
    reference = keras.layers.MultiHeadAttention(4, 16, dropout=dropout)
    reference(x, x)
    return reference


def _mha_like(reference, policy, x):
    """A MultiHeadAttention under `policy` with the reference's weights."""
    kmp.set_policy(policy)
    layer = keras.layers.MultiHeadAttention(4, 16, dropout=reference.dropout)
    layer(x, x)
    layer.set_weights(reference.get_weights())
    return layer


def _prepared(layer, shape):
    """Prepares `layer` inside a model where it is not the output."""
    inputs = keras.Input(shape)
    outputs = keras.layers.Identity()(layer(inputs, inputs))
    kmp.prepare(keras.Model(inputs, outputs))
    return layer


ATTENTION_PATHS = {
    "fused": ({"dropout": 0.0}, {}),
    "dropout": ({"dropout": 0.1}, {}),
    "scores": ({"dropout": 0.0}, {"return_attention_scores": True}),
    "mask": ({"dropout": 0.0}, {"attention_mask": "causal"}),
}


@pytest.mark.parametrize("path", sorted(ATTENTION_PATHS))
def test_plain_keras_float16_attention_goes_nan_and_kmp_does_not(path):
    ctor, call = ATTENTION_PATHS[path]
    x = np.random.RandomState(0).randn(4, 16, 64).astype("float32") * 300
    if call.get("attention_mask") == "causal":
        call = {"attention_mask": np.tril(np.ones((4, 16, 16), bool))}

    def run(layer):
        y = layer(x, x, training=False, **call)
        return np.asarray(y[0] if isinstance(y, tuple) else y, "float32")

    reference = _float32_mha(ctor["dropout"], x)
    plain = _mha_like(reference, "mixed_float16", x)
    assert np.isnan(run(plain)).mean() > 0.9  # the failure kmp exists to fix

    layer = _mha_like(reference, "mixed_float16", x)
    fixed = run(_prepared(layer, (16, 64)))
    assert np.isfinite(fixed).all()
    assert relative_error(fixed, run(reference)) < RELATIVE["float16"]
    out = layer(x, x)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"  # interface


def test_float16_attention_at_scale_100_is_nan_in_keras_and_finite_in_kmp():
    x = np.random.RandomState(0).randn(4, 16, 64).astype("float32") * 100
    reference = _float32_mha(0.0, x)
    plain = _mha_like(reference, "mixed_float16", x)
    assert np.isnan(np.asarray(plain(x, x), "float32")).any()
    layer = _mha_like(reference, "mixed_float16", x)
    y = _prepared(layer, (16, 64))(x, x)
    assert relative_error(y, reference(x, x)) < RELATIVE["float16"]


@pytest.mark.parametrize("path", ["fused", "scores"])
def test_float32_scores_under_bfloat16_shrink_the_error_to_bfloat16_rounding(path):
    ctor, call = ATTENTION_PATHS[path]
    x = np.random.RandomState(0).randn(4, 16, 64).astype("float32") * 30

    def run(layer):
        y = layer(x, x, **call)
        return y[0] if isinstance(y, tuple) else y

    reference = _float32_mha(ctor["dropout"], x)
    plain = _mha_like(reference, "mixed_bfloat16", x)
    # Keras's bfloat16 attention at this scale: 9-10% off float32, by CPU kind.
    assert relative_error(run(plain), run(reference)) > 0.05
    attention.set_attention_scores("float32")
    layer = _mha_like(reference, "mixed_bfloat16", x)
    fixed = run(_prepared(layer, (16, 64)))
    assert relative_error(fixed, run(reference)) < RELATIVE["bfloat16"]


def test_under_bfloat16_the_default_leaves_keras_attention_exactly_as_it_is():
    x = np.random.RandomState(0).randn(2, 8, 32).astype("float32")
    reference = _float32_mha(0.0, x)
    plain = _mha_like(reference, "mixed_bfloat16", x)
    layer = _prepared(_mha_like(reference, "mixed_bfloat16", x), (8, 32))
    assert {c.compute_dtype for c in layer._flatten_layers()} == {"bfloat16"}
    np.testing.assert_array_equal(
        np.asarray(layer(x, x), "float32"), np.asarray(plain(x, x), "float32")
    )


def test_compute_mode_leaves_float16_attention_as_keras_has_it():
    attention.set_attention_scores("compute")
    x = np.ones((1, 4, 8), "float32")
    layer = _prepared(_mha_like(_float32_mha(0.0, x), "mixed_float16", x), (4, 8))
    assert layer.query_dense.compute_dtype == "float16"


def test_bfloat16_softmax_error_is_large_in_keras_and_gone_in_kmp():
    logits = np.random.RandomState(0).randn(4, 16, 64).astype("float32") * 30
    reference = np.asarray(keras.layers.Softmax()(logits))
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((16, 64)), keras.layers.Softmax(), keras.layers.Identity()]
    )
    plain = np.asarray(model(logits), "float32")
    visible = reference > 1e-3
    relative = np.abs(plain - reference)[visible] / reference[visible]
    assert relative.max() > 0.2
    fixed = np.asarray(kmp.prepare(model).layers[0](logits))  # the softmax
    np.testing.assert_allclose(fixed, reference, rtol=1e-5, atol=1e-7)
