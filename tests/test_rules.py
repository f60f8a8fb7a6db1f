import keras
import numpy as np
import pytest
from tolerances import RELATIVE
from tolerances import relative_error

import kmp
from kmp import rules

MIXED = ["mixed_float16", "mixed_bfloat16"]


def _compute(policy_name):
    return {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}[policy_name]


def dtype_of(x):
    return keras.backend.standardize_dtype(x.dtype)


def transformer_classifier():
    tokens = keras.Input((16,), dtype="int32")
    x = keras.layers.Embedding(200, 32, mask_zero=True, name="embed")(tokens)
    attn = keras.layers.MultiHeadAttention(4, 8, dropout=0.1, name="attn")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(x + attn)
    x = keras.layers.Dense(32, activation="relu", name="ffn")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    out = keras.layers.Dense(5, activation="softmax", name="head")(x)
    return keras.Model(tokens, out, name="transformer")


def small_cnn():
    return keras.Sequential(
        [
            keras.Input((12, 12, 3)),
            keras.layers.Conv2D(8, 3, name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(name="relu"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(4, name="logits"),
        ],
        name="cnn",
    )


def layer_outputs(model, x):
    """Runs `model` eagerly and returns {layer name: its real output}.

    Real tensors, not the functional graph's KerasTensors: those keep the
    dtypes the model was built with.
    """
    layers = [
        layer
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    probe = keras.Model(model.inputs[0], {layer.name: layer.output for layer in layers})
    return probe(x, training=False)


@pytest.mark.parametrize("policy", MIXED)
def test_transformer_classifier_computes_16bit_with_float32_islands(policy):
    kmp.set_policy(policy)
    model = kmp.prepare(transformer_classifier())
    compute = _compute(policy)
    outputs = layer_outputs(model, np.random.randint(1, 200, (2, 16)))

    for name in ("embed", "ffn"):
        layer = model.get_layer(name)
        assert all(w.dtype == "float32" for w in layer.weights)
        assert dtype_of(outputs[name]) == compute
    attn = model.get_layer("attn")
    assert all(w.dtype == "float32" for w in attn.weights)
    # Value/output projections stay 16-bit; scores and softmax are float32.
    assert attn.value_dense.compute_dtype == compute
    assert attn.output_dense.compute_dtype == compute
    assert attn.query_dense.compute_dtype == "float32"
    assert attn.key_dense.compute_dtype == "float32"
    assert dtype_of(outputs["attn"]) == compute
    _, scores = attn(
        np.ones((2, 16, 32), "float32"),
        np.ones((2, 16, 32), "float32"),
        return_attention_scores=True,
    )
    assert dtype_of(scores) == "float32"
    assert dtype_of(outputs["norm"]) == "float32"
    assert dtype_of(outputs["head"]) == "float32"
    assert dtype_of(model(np.ones((1, 16), "int32"))) == "float32"


@pytest.mark.parametrize("policy", MIXED)
def test_cnn_computes_16bit_with_float32_batchnorm(policy):
    kmp.set_policy(policy)
    model = kmp.prepare(small_cnn())
    compute = _compute(policy)
    outputs = layer_outputs(model, np.random.rand(2, 12, 12, 3).astype("float32"))
    slow_conv = policy == "mixed_float16" and rules._float16_convolutions_are_slow()
    for name in ("conv", "logits"):
        assert model.get_layer(name).kernel.dtype == "float32"
    assert dtype_of(outputs["conv"]) == ("float32" if slow_conv else compute)
    assert dtype_of(outputs["logits"]) == compute
    assert dtype_of(outputs["bn"]) == "float32"
    assert all(w.dtype == "float32" for w in model.get_layer("bn").weights)


@pytest.mark.parametrize("policy", MIXED)
def test_layers_report_their_new_dtypes_symbolically(policy):
    # Symbolic check: a prepared layer called on a keras.Input gives the
    # dtype it will compute in, without running anything.
    kmp.set_policy(policy)
    model = kmp.prepare(small_cnn())
    features = keras.Input((12, 12, 8))
    assert model.get_layer("bn")(features).dtype == "float32"
    assert model.get_layer("relu")(features).dtype == _compute(policy)


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
    inputs = keras.Input(shape)
    kmp.prepare(keras.Model(inputs, layer(inputs, inputs)))
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


def test_float16_attention_at_scale_100_is_nan_in_keras_and_finite_in_kmp():
    x = np.random.RandomState(0).randn(4, 16, 64).astype("float32") * 100
    reference = _float32_mha(0.0, x)
    plain = _mha_like(reference, "mixed_float16", x)
    assert np.isnan(np.asarray(plain(x, x), "float32")).any()
    layer = _mha_like(reference, "mixed_float16", x)
    y = _prepared(layer, (16, 64))(x, x)
    assert relative_error(y, reference(x, x)) < RELATIVE["float16"]


@pytest.mark.parametrize("path", ["fused", "scores"])
def test_bfloat16_attention_error_shrinks_to_bfloat16_rounding(path):
    ctor, call = ATTENTION_PATHS[path]
    x = np.random.RandomState(0).randn(4, 16, 64).astype("float32") * 30

    def run(layer):
        y = layer(x, x, **call)
        return y[0] if isinstance(y, tuple) else y

    reference = _float32_mha(ctor["dropout"], x)
    plain = _mha_like(reference, "mixed_bfloat16", x)
    assert relative_error(run(plain), run(reference)) > 0.1
    layer = _mha_like(reference, "mixed_bfloat16", x)
    fixed = run(_prepared(layer, (16, 64)))
    assert relative_error(fixed, run(reference)) < RELATIVE["bfloat16"]


def test_bfloat16_softmax_error_is_large_in_keras_and_gone_in_kmp():
    logits = np.random.RandomState(0).randn(4, 16, 64).astype("float32") * 30
    reference = np.asarray(keras.layers.Softmax()(logits))
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((16, 64)), keras.layers.Softmax()])
    plain = np.asarray(model(logits), "float32")
    visible = reference > 1e-3
    relative = np.abs(plain - reference)[visible] / reference[visible]
    assert relative.max() > 0.2
    fixed = np.asarray(kmp.prepare(model)(logits))
    np.testing.assert_allclose(fixed, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "layer",
    [
        keras.layers.BatchNormalization,
        keras.layers.LayerNormalization,
        lambda: keras.layers.GroupNormalization(groups=2),
        keras.layers.RMSNormalization,
        keras.layers.UnitNormalization,
        keras.layers.Softmax,
        lambda: keras.layers.Activation("softmax"),
        lambda: keras.layers.Activation("log_softmax"),
        lambda: keras.layers.Dense(4, activation="softmax"),
    ],
)
@pytest.mark.parametrize("policy", MIXED)
def test_sensitive_layers_compute_in_float32_anywhere_in_the_model(layer, policy):
    kmp.set_policy(policy)
    sensitive = layer()
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), sensitive, keras.layers.Dense(2)]
    )
    kmp.prepare(model)
    assert sensitive.compute_dtype == "float32"
    assert model.layers[0].compute_dtype == _compute(policy)
    assert model.layers[2].compute_dtype == _compute(policy)


def test_sigmoid_output_layer_is_float32_but_hidden_sigmoid_is_not():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, activation="sigmoid", name="gate"),
            keras.layers.Dense(1, activation="sigmoid", name="out"),
        ]
    )
    kmp.prepare(model)
    assert model.get_layer("gate").compute_dtype == "float16"
    assert model.get_layer("out").compute_dtype == "float32"
    assert dtype_of(model(np.ones((1, 8)))) == "float32"


def test_defaults_do_not_apply_under_float32_policies():
    model = kmp.prepare(small_cnn())
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}


def test_prepare_is_idempotent():
    kmp.set_policy("mixed_float16")
    model = transformer_classifier()
    first = kmp.precision_report(kmp.prepare(model))
    second = kmp.precision_report(kmp.prepare(model))
    assert first == second
    assert first.row("attn/value").compute_dtype == "float16"


def test_explicit_dtype_beats_every_rule():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("name:pinned", "mixed_bfloat16")
    kmp.set_layer_policy(keras.layers.Dense, "float32")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, dtype="float64", name="pinned")]
    )
    kmp.prepare(model)
    assert model.get_layer("pinned").compute_dtype == "float64"
    assert kmp.precision_report(model).row("pinned").rule == "explicit dtype="


def test_name_rule_beats_class_rule_beats_defaults():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("name:special", "mixed_bfloat16")
    kmp.set_layer_policy(keras.layers.Dense, "float32")
    kmp.set_layer_policy(keras.layers.LayerNormalization, "mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="special"),
            keras.layers.Dense(4, name="plain"),
            keras.layers.LayerNormalization(name="norm"),
        ]
    )
    kmp.prepare(model)
    assert model.get_layer("special").compute_dtype == "bfloat16"
    assert model.get_layer("plain").compute_dtype == "float32"
    assert model.get_layer("norm").compute_dtype == "float16"
    report = kmp.precision_report(model)
    assert report.row("special").rule == "rule name:special"
    assert report.row("plain").rule == "rule Dense"


def test_class_rules_match_user_classes_and_their_subclasses():
    class Block(keras.layers.Layer):
        def call(self, x):
            return x * 2

    class SpecialBlock(Block):
        pass

    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy(Block, "float32")
    model = keras.Sequential([keras.Input((4,)), Block(), SpecialBlock()])
    kmp.prepare(model)
    assert [layer.compute_dtype for layer in model.layers] == ["float32", "float32"]


@pytest.mark.parametrize("gpu", [False, True])
def test_float16_convolutions_go_float32_only_on_cpu_only_machines(gpu, monkeypatch):
    from kmp import hardware

    machine = hardware.Capabilities(
        cpu=hardware.CPUInfo("cpu", 2, frozenset({"avx512_fp16"})),
        gpus=(hardware.GPUInfo("A100", (8, 0)),) if gpu else (),
        tpus=0,
    )
    monkeypatch.setattr(hardware, "capabilities", lambda: machine)
    for policy, expected in (
        ("mixed_float16", "float16" if gpu else "float32"),
        ("mixed_bfloat16", "bfloat16"),
    ):
        kmp.set_policy(policy)
        model = kmp.prepare(small_cnn())
        assert model.get_layer("conv").compute_dtype == expected, policy
        assert model.get_layer("logits").compute_dtype == _compute(policy)
    kmp.set_policy("mixed_float16")
    report = kmp.precision_report(kmp.prepare(small_cnn()))
    assert (report.row("conv").rule == rules._SLOW_CPU_CONVOLUTION) is (not gpu)


def test_class_name_patterns_match_class_names():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("class:Conv*", "float32")
    model = kmp.prepare(small_cnn())
    assert model.get_layer("conv").compute_dtype == "float32"
    assert model.get_layer("logits").compute_dtype == "float16"


def test_rules_on_a_container_layer_cover_the_layers_inside_it():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(4, name="inner")

        def call(self, x):
            return self.inner(x)

    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("name:block", "float32")
    block = Block(name="block")
    model = keras.Sequential([keras.Input((4,)), block, keras.layers.Dense(2)])
    kmp.prepare(model)
    assert block.inner.compute_dtype == "float32"
    assert model.layers[-1].compute_dtype == "float16"
    assert kmp.precision_report(model).row("block/inner").rule == "inherited"
    kmp.set_layer_policy("name:block", None)
    kmp.prepare(model)
    assert block.inner.compute_dtype == "float16"


def test_same_rank_rules_that_disagree_raise_and_change_nothing():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy(keras.layers.Dense, "float32")
    kmp.set_layer_policy("class:Den*", "mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(4, name="d"),
        ]
    )
    with pytest.raises(kmp.RuleConflictError, match=r"'d'.*rule Dense.*rule class:Den"):
        kmp.prepare(model)
    assert [layer.compute_dtype for layer in model.layers] == ["float16", "float16"]


def test_same_rank_rules_that_agree_do_not_raise():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy(keras.layers.Dense, "float32")
    kmp.set_layer_policy("class:Den*", "float32")
    model = kmp.prepare(keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)]))
    assert model.layers[0].compute_dtype == "float32"


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
    assert [r.policy.name for r in kmp.layer_rules()] == ["mixed_bfloat16"]
    kmp.set_layer_policy("name:x", None)
    assert kmp.layer_rules() == []


def test_nested_models_get_rules_and_inner_outputs_are_found():
    kmp.set_policy("mixed_float16")
    inner = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, name="dense"),
            keras.layers.LayerNormalization(name="layer_normalization"),
        ],
        name="inner",
    )
    head = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(3, activation="sigmoid", name="p")],
        name="head",
    )
    inputs = keras.Input((8,))
    model = keras.Model(inputs, head(inner(inputs)))
    kmp.prepare(model)
    report = kmp.precision_report(model)
    assert report.row("inner/dense").compute_dtype == "float16"
    assert report.row("inner/layer_normalization").compute_dtype == "float32"
    assert report.row("head/p").rule == "default: sigmoid output in float32"
    assert dtype_of(model(np.ones((2, 8)))) == "float32"


def test_subclassed_model_gets_rules_on_its_layers():
    class Classifier(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8)
            self.norm = keras.layers.LayerNormalization()
            self.out = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.out(self.norm(self.hidden(x)))

    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(Classifier())
    assert model.hidden.compute_dtype == "bfloat16"
    assert model.norm.compute_dtype == "float32"
    assert model.out.compute_dtype == "float32"
    assert dtype_of(model(np.ones((2, 4)))) == "float32"


def test_unbuilt_attention_is_float32_until_prepared_again_after_build():
    kmp.set_policy("mixed_float16")
    attn = keras.layers.MultiHeadAttention(2, 4)
    kmp.prepare(keras.Sequential([attn]))  # not built: no projections yet
    assert attn.compute_dtype == "float32"
    x = np.ones((1, 3, 8), "float32")
    inputs = keras.Input((3, 8))
    model = keras.Model(inputs, attn(inputs, inputs))
    assert attn.value_dense.compute_dtype == "float32"  # built under float32
    kmp.prepare(model)
    assert attn.value_dense.compute_dtype == "float16"
    assert attn.query_dense.compute_dtype == "float32"
    assert np.isfinite(np.asarray(attn(x, x), "float32")).all()


def test_group_query_attention_scores_are_float32():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((6, 16))
    gqa = keras.layers.GroupQueryAttention(8, 4, 2)
    model = kmp.prepare(keras.Model(inputs, gqa(inputs, inputs)))
    report = kmp.precision_report(model)
    paths = {row.path: row.compute_dtype for row in report}
    assert paths[f"{gqa.name}/query"] == "float32"
    assert paths[f"{gqa.name}/key"] == "float32"
    assert paths[f"{gqa.name}/value"] == "float16"


def test_precision_report_is_data_and_a_table():
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(small_cnn())
    report = kmp.precision_report(model)
    assert [row.path for row in report] == ["conv", "bn", "relu", "flat", "logits"]
    bn = report.row("bn")
    assert (bn.class_name, bn.compute_dtype, bn.variable_dtype, bn.rule) == (
        "BatchNormalization",
        "float32",
        "float32",
        "default: normalization in float32",
    )
    text = str(report)
    assert "mixed_float16" in text.splitlines()[0]
    assert "default: normalization in float32" in text
    with pytest.raises(KeyError, match="Paths: conv"):
        report.row("missing")


def test_report_before_prepare_says_so():
    kmp.set_policy("mixed_float16")
    report = kmp.precision_report(small_cnn())
    assert report.row("bn").compute_dtype == "float16"
    assert report.row("bn").rule == "policy (kmp.prepare not applied)"


def test_prepare_and_report_reject_non_models():
    for fn in (kmp.prepare, kmp.precision_report):
        with pytest.raises(TypeError, match="expects a Keras model"):
            fn("model")


def test_compile_applies_rules_before_compiling():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(
        transformer_classifier(),
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
    )
    assert model.compiled
    assert model.get_layer("head").compute_dtype == "float32"
    with pytest.raises(TypeError, match=r"expects a keras\.Model"):
        kmp.compile(keras.layers.Dense(2), optimizer="adam")


@pytest.mark.slow
def test_mixed_float16_transformer_trains_with_finite_loss():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(
        transformer_classifier(),
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
    )
    x = np.random.randint(1, 200, (64, 16))
    y = x[:, 0] % 5
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_rules_module_docstring_states_the_resolution_order():
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


def test_a_sigmoid_inside_a_nested_model_that_is_not_the_output_stays_16bit():
    kmp.set_policy("mixed_float16")
    gates = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, activation="sigmoid", name="gate")],
        name="gates",
    )
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, name="head")(gates(inputs))
    model = kmp.prepare(keras.Model(inputs, outputs))
    report = kmp.precision_report(model)
    assert report.row("gates/gate").compute_dtype == "float16"
    assert report.row("head").compute_dtype == "float16"


def test_rules_naming_different_policies_with_the_same_dtypes_agree():
    kmp.register_policy(kmp.Policy("fp32", "float32", "float32"))
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy(keras.layers.Dense, "float32")
    kmp.set_layer_policy("class:Den*", "fp32")
    model = kmp.prepare(keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)]))
    assert model.layers[0].compute_dtype == "float32"
