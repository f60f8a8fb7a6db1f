"""kmp.prepare and the plan it applies: interfaces keep their dtype, outputs
become float32, sensitive layers compute in float32 where that is safe."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tolerances import RELATIVE
from tolerances import relative_error

import kmp
from kmp.planning import decisions as planning
from kmp.precision import rules

MIXED = ["mixed_float16", "mixed_bfloat16"]
COMPUTE = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


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
    """Runs `model` eagerly and returns {layer name: its real output}."""
    layers = [
        layer
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    probe = keras.Model(model.inputs[0], {layer.name: layer.output for layer in layers})
    return probe(x, training=False)


@pytest.mark.parametrize("policy", MIXED)
def test_transformer_classifier_keeps_interfaces_and_returns_float32(policy):
    kmp.set_policy(policy)
    model = kmp.prepare(transformer_classifier())
    compute = COMPUTE[policy]
    outputs = layer_outputs(model, np.random.randint(1, 200, (2, 16)))
    for name in ("embed", "attn", "norm", "ffn"):
        assert dtype_of(outputs[name]) == compute, name
        assert all(w.dtype == "float32" for w in model.get_layer(name).weights)
    attn = model.get_layer("attn")
    # Under float16 the scores are float32 (they overflow otherwise); under
    # bfloat16 kmp leaves Keras's attention as it is (see set_attention_scores).
    scores = "float32" if policy == "mixed_float16" else compute
    assert attn.query_dense.compute_dtype == scores
    assert attn.key_dense.compute_dtype == scores
    assert attn.value_dense.compute_dtype == compute
    assert attn.output_dense.compute_dtype == compute
    # Keras's LayerNormalization computes in float32 inside: left alone.
    assert model.get_layer("norm").compute_dtype == compute
    assert dtype_of(outputs["head"]) == "float32"
    assert dtype_of(model(np.ones((1, 16), "int32"))) == "float32"


@pytest.mark.parametrize("policy", MIXED)
def test_cnn_keeps_batchnorm_16bit_and_casts_the_output_to_float32(policy):
    kmp.set_policy(policy)
    model = kmp.prepare(small_cnn())
    compute = COMPUTE[policy]
    x = np.random.rand(2, 12, 12, 3).astype("float32")
    outputs = layer_outputs(model, x)
    slow_conv = policy == "mixed_float16" and planning._float16_convolutions_are_slow()
    assert dtype_of(outputs["conv"]) == ("float32" if slow_conv else compute)
    assert dtype_of(outputs["bn"]) == compute
    assert dtype_of(outputs["relu"]) == compute
    assert dtype_of(outputs["logits"]) == compute  # cast where handed on:
    assert model.predict(x, verbose=0).dtype == np.float32
    for name in ("conv", "bn", "logits"):
        assert all(w.dtype == "float32" for w in model.get_layer(name).weights)


@pytest.mark.parametrize(
    "layer",
    [
        keras.layers.Softmax,
        lambda: keras.layers.Activation("softmax"),
        lambda: keras.layers.Activation("log_softmax"),
        lambda: keras.layers.Dense(8, activation="softmax"),
        keras.layers.UnitNormalization,
    ],
)
@pytest.mark.parametrize("policy", MIXED)
def test_sensitive_layers_in_a_graph_compute_in_float32(layer, policy):
    kmp.set_policy(policy)
    sensitive = layer()
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), sensitive, keras.layers.Dense(2)]
    )
    kmp.prepare(model)
    assert sensitive.compute_dtype == "float32"
    assert model.layers[0].compute_dtype == COMPUTE[policy]


@pytest.mark.parametrize(
    "layer",
    [
        keras.layers.BatchNormalization,
        keras.layers.LayerNormalization,
        lambda: keras.layers.GroupNormalization(groups=2),
        keras.layers.RMSNormalization,
    ],
)
@pytest.mark.parametrize("policy", MIXED)
def test_keras_normalization_layers_are_left_alone(layer, policy):
    kmp.set_policy(policy)
    norm = layer()
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), norm, keras.layers.Dense(2)]
    )
    kmp.prepare(model)
    assert norm.compute_dtype == COMPUTE[policy]
    row = kmp.precision_report(model).row(norm.name)
    assert row.inside == "float32 inside (Keras)"
    assert row.returns == COMPUTE[policy]


@pytest.mark.parametrize(
    "layer",
    [
        lambda: keras.layers.BatchNormalization(),
        lambda: keras.layers.LayerNormalization(),
        lambda: keras.layers.GroupNormalization(groups=2),
        lambda: keras.layers.RMSNormalization(),
    ],
    ids=["BatchNormalization", "LayerNormalization", "GroupNormalization", "RMS"],
)
def test_keras_normalization_computes_its_statistics_in_float32(layer):
    # Inputs of 300-500: their squares (9e4-2.5e5) overflow float16 (65504), so
    # a variance computed in float16 would be inf and the output 0 or NaN.
    # Finite outputs within float16 rounding of the float32 layer prove the
    # statistics are computed in float32 inside.
    rng = np.random.default_rng(0)
    x = (400 + 100 * rng.standard_normal((8, 8))).astype("float32")
    reference = layer()
    want = np.asarray(reference(x, training=True))
    kmp.set_policy("mixed_float16")
    sixteen = layer()
    sixteen.build((None, 8))
    sixteen.set_weights(reference.get_weights())
    got = sixteen(x, training=True)
    assert dtype_of(got) == "float16"
    got = np.asarray(got, "float32")
    assert np.isfinite(got).all()
    assert relative_error(got, want) < RELATIVE["float16"]


def test_layer_normalization_is_finite_at_input_scale_500_under_float16():
    x = (500 * np.random.default_rng(1).standard_normal((4, 6, 32))).astype("float32")
    want = np.asarray(keras.layers.LayerNormalization()(x))
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((6, 32))
    norm = keras.layers.LayerNormalization()
    kmp.prepare(keras.Model(inputs, keras.layers.Dense(2)(norm(inputs))))
    got = np.asarray(norm(x), "float32")
    assert np.isfinite(got).all()
    assert relative_error(got, want) < RELATIVE["float16"]
    assert norm.compute_dtype == "float16"  # left alone: float32 inside


def test_unit_normalization_overflows_in_keras_float16_and_not_under_kmp():
    x = np.full((2, 8), 300.0, "float32")  # squares sum to 7.2e5 > 65504
    want = np.asarray(keras.layers.UnitNormalization()(x))
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.UnitNormalization(), keras.layers.Dense(2)]
    )
    plain = np.asarray(model.layers[0](x), "float32")
    assert not np.allclose(plain, want, rtol=0.1)  # inf norm: zeros
    kmp.prepare(model)
    fixed = np.asarray(model.layers[0](x), "float32")
    np.testing.assert_allclose(fixed, want, rtol=1e-5)


@pytest.mark.parametrize("policy", MIXED)
def test_every_model_output_is_cast_to_float32_and_a_sigmoid_is_float32(policy):
    # TensorFlow's guide asks for a float32 output; kmp casts it, as its
    # Activation('linear', dtype='float32') does.
    kmp.set_policy(policy)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="sigmoid", name="gate")(inputs)
    value = keras.layers.Dense(1, name="value")(hidden)
    prob = keras.layers.Dense(1, activation="sigmoid", name="prob")(hidden)
    model = kmp.prepare(keras.Model(inputs, [value, prob]))
    model.get_layer("value").set_weights([np.zeros((8, 1)), np.array([1234.567])])
    value_out, prob_out = model.predict(np.ones((2, 4)), verbose=0)
    assert value_out.dtype == prob_out.dtype == np.float32
    # The value carries its policy's rounding (bfloat16's spacing is 8 there).
    rounded = {"mixed_bfloat16": 1232.0, "mixed_float16": 1235.0}[policy]
    np.testing.assert_array_equal(value_out, rounded)
    assert model.get_layer("gate").compute_dtype == COMPUTE[policy]
    assert model.get_layer("value").compute_dtype == COMPUTE[policy]
    assert model.get_layer("prob").compute_dtype == "float32"
    report = kmp.precision_report(model)
    assert report.row("value").rule == planning.OUTPUT
    assert report.row("prob").rule == planning.SIGMOID_OUTPUT
    assert report.outputs == (COMPUTE[policy], "float32")  # as the model returns
    # A head that needs float32's digits gets them from a rule.
    kmp.set_layer_policy("name:value", "float32")
    kmp.prepare(model)
    value_out, _ = model.predict(np.ones((2, 4)), verbose=0)
    np.testing.assert_allclose(value_out, 1234.567, rtol=1e-6)


@pytest.mark.parametrize("policy", MIXED)
def test_a_sigmoid_output_keeps_the_gradient_of_its_saturated_logits(policy):
    # Keras's binary crossentropy reads the logits a sigmoid keeps; a 16-bit
    # sigmoid cast by the loss loses them, and its clipped log has no slope.
    kmp.set_policy(policy)
    inputs = keras.Input((1,))
    prob = keras.layers.Dense(1, activation="sigmoid", name="prob")(inputs)
    model = kmp.prepare(keras.Model(inputs, prob))
    model.get_layer("prob").set_weights([np.ones((1, 1)), np.zeros(1)])
    x, y = tf.constant([[-20.0]]), tf.constant([[1.0]])
    with tf.GradientTape() as tape:
        loss = keras.losses.binary_crossentropy(y, model(x))
    (grad, _) = tape.gradient(loss, model.get_layer("prob").trainable_weights)
    np.testing.assert_allclose(float(loss[0]), 20.0, rtol=1e-3)
    np.testing.assert_allclose(float(grad[0, 0]), 20.0, rtol=1e-3)


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
    kmp.set_layer_policy(keras.layers.Softmax, "mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="special"),
            keras.layers.Dense(4, name="plain"),
            keras.layers.Softmax(name="probs"),
            keras.layers.ReLU(name="out"),
        ]
    )
    kmp.prepare(model)
    assert model.get_layer("special").compute_dtype == "bfloat16"
    assert model.get_layer("plain").compute_dtype == "float32"
    assert model.get_layer("probs").compute_dtype == "float16"
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
    model = keras.Sequential(
        [keras.Input((4,)), Block(), SpecialBlock(), keras.layers.ReLU()]
    )
    kmp.prepare(model)
    assert [layer.compute_dtype for layer in model.layers[:2]] == [
        "float32",
        "float32",
    ]


@pytest.mark.parametrize("gpu", [False, True])
def test_float16_convolutions_go_float32_only_on_cpu_only_machines(gpu, monkeypatch):
    from kmp.backend import machine as probe

    machine = probe.Capabilities(
        cpu=probe.CPUInfo("cpu", 2, frozenset({"avx512_fp16"})),
        gpus=(probe.GPUInfo("A100", (8, 0)),) if gpu else (),
        tpus=0,
    )
    monkeypatch.setattr(probe, "capabilities", lambda: machine)
    for policy, expected in (
        ("mixed_float16", "float16" if gpu else "float32"),
        ("mixed_bfloat16", "bfloat16"),
    ):
        kmp.set_policy(policy)
        model = kmp.prepare(small_cnn())
        assert model.get_layer("conv").compute_dtype == expected, policy
        assert model.get_layer("bn").compute_dtype == COMPUTE[policy]
    kmp.set_policy("mixed_float16")
    report = kmp.precision_report(kmp.prepare(small_cnn()))
    slow = "default: float16 convolutions are slow on CPUs"
    assert (report.row("conv").rule == slow) is (not gpu)


def test_class_name_patterns_match_class_names():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("class:Dens*", "mixed_bfloat16")
    model = kmp.prepare(small_cnn())
    assert model.get_layer("logits").compute_dtype == "bfloat16"
    assert model.get_layer("relu").compute_dtype == "float16"


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
    assert kmp.precision_report(model).row("block/inner").rule == "inherited"
    kmp.set_layer_policy("name:block", None)
    kmp.prepare(model)
    assert block.inner.compute_dtype == "float16"


def test_same_rank_rules_that_disagree_raise_and_change_nothing():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy(keras.layers.Dense, "float32")
    kmp.set_layer_policy("class:Den*", "mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Softmax(), keras.layers.Dense(4, name="d")]
    )
    with pytest.raises(
        rules.RuleConflictError, match=r"'d'.*rule Dense.*rule class:Den"
    ):
        kmp.prepare(model)
    assert [layer.compute_dtype for layer in model.layers] == ["float16", "float16"]


def test_same_rank_rules_that_agree_do_not_raise():
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy(keras.layers.ReLU, "float32")
    kmp.set_layer_policy("class:Re*", "float32")
    model = kmp.prepare(
        keras.Sequential(
            [keras.Input((4,)), keras.layers.ReLU(), keras.layers.Dense(4)]
        )
    )
    assert model.layers[0].compute_dtype == "float32"


def test_rules_naming_different_policies_with_the_same_dtypes_agree():
    kmp.register_policy(kmp.Policy("fp32", "float32", "float32"))
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy(keras.layers.ReLU, "float32")
    kmp.set_layer_policy("class:Re*", "fp32")
    model = kmp.prepare(
        keras.Sequential(
            [keras.Input((4,)), keras.layers.ReLU(), keras.layers.Dense(4)]
        )
    )
    assert model.layers[0].compute_dtype == "float32"


def test_nested_models_get_rules_and_inner_outputs_are_found():
    kmp.set_policy("mixed_float16")
    inner = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, name="dense"),
            keras.layers.Softmax(name="probs"),
            keras.layers.Dense(8, name="mix"),
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
    assert report.row("inner/probs").compute_dtype == "float32"
    assert report.row("inner/mix").compute_dtype == "float16"
    assert report.row("head/p").rule == planning.SIGMOID_OUTPUT
    assert dtype_of(model(np.ones((2, 8)))) == "float32"


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
    assert report.row("head").rule == planning.OUTPUT


def test_a_subclassed_model_keeps_what_its_layers_return():
    # Its call is Python code kmp cannot see: a float32 softmax there would
    # change what `call` computes with. Its output is cast where Keras's
    # loss and predict take it.
    class Classifier(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8)
            self.norm = keras.layers.LayerNormalization()
            self.out = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.out(self.norm(self.hidden(x)) + self.hidden(x))

    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(Classifier())
    y = model(np.ones((2, 4)))
    assert dtype_of(y) == "bfloat16"
    assert model.out.compute_dtype == "bfloat16"
    kinds = kmp.debug.precision_audit(model).kinds()
    assert "16-bit output" not in kinds
    assert model.predict(np.ones((2, 4)), verbose=0).dtype == np.float32


def test_an_unbuilt_attention_layer_is_left_alone_until_prepared_after_build():
    kmp.set_policy("mixed_float16")
    attn = keras.layers.MultiHeadAttention(2, 4)
    with pytest.warns(UserWarning, match="not built yet"):
        kmp.prepare(keras.Sequential([attn, keras.layers.Dense(2)]))
    assert attn.compute_dtype == "float16"  # untouched: no sublayers yet
    inputs = keras.Input((3, 8))
    model = keras.Model(inputs, keras.layers.Dense(2)(attn(inputs, inputs)))
    kmp.prepare(model)
    assert attn.value_dense.compute_dtype == "float16"
    assert attn.query_dense.compute_dtype == "float32"
    x = np.ones((1, 3, 8), "float32")
    assert dtype_of(attn(x, x)) == "float16"


def test_group_query_attention_scores_are_float32_under_float16():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((6, 16))
    gqa = keras.layers.GroupQueryAttention(8, 4, 2)
    outputs = keras.layers.Dense(4)(gqa(inputs, inputs))
    model = kmp.prepare(keras.Model(inputs, outputs))
    report = kmp.precision_report(model)
    rows = {row.path: row for row in report}
    assert rows[f"{gqa.name}/query"].compute_dtype == "float32"
    assert rows[f"{gqa.name}/key"].compute_dtype == "float32"
    assert rows[f"{gqa.name}/value"].compute_dtype == "float16"
    assert rows[gqa.name].returns == "float16"


def test_a_subclass_with_its_own_attention_code_is_not_rewired():
    class CachedAttention(keras.layers.MultiHeadAttention):
        """Writes the key into a float16 cache: a float32 key would not fit."""

        def call(self, query, value, key=None, **kwargs):
            key = self._key_dense(value)
            cache = keras.ops.zeros_like(key)
            key = keras.ops.slice_update(cache, [0, 0, 0, 0], key)
            query = self._query_dense(query)
            value = self._value_dense(value)
            out, _ = self._compute_attention(query, key, value)
            return self._output_dense(out)

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((6, 16))
    layer = CachedAttention(2, 8)
    model = keras.Model(inputs, keras.layers.Dense(2)(layer(inputs, inputs)))
    kmp.prepare(model)
    assert layer.key_dense.compute_dtype == "float16"
    y = model(np.ones((2, 6, 16), "float32"))
    assert np.isfinite(np.asarray(y)).all()


def test_preprocessing_and_integer_layers_are_left_alone_under_every_policy():
    for policy in ["float32", *MIXED]:
        kmp.set_policy(policy)
        words = keras.Input((3,), dtype="string")
        ids = keras.layers.StringLookup(vocabulary=["a", "b", "c"], name="lookup")(
            words
        )
        numbers = keras.Input((3,), dtype="int64")
        hashed = keras.layers.Hashing(16, name="hashing")(numbers)
        x = keras.layers.Embedding(20, 8)(ids) + keras.layers.Embedding(20, 8)(hashed)
        out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))
        model = keras.Model([words, numbers], out)
        before = {
            name: model.get_layer(name).dtype_policy.name
            for name in ("lookup", "hashing")
        }
        kmp.compile(model, optimizer="sgd", loss="mse")
        after = {
            name: model.get_layer(name).dtype_policy.name
            for name in ("lookup", "hashing")
        }
        assert after == before, policy
        report = kmp.precision_report(model)
        assert report.row("lookup").rule == planning.NOT_FLOAT
        data = [tf.constant([["a", "b", "c"]] * 4), np.arange(12).reshape(4, 3)]
        history = model.fit(data, np.ones((4, 2)), verbose=0)
        assert np.isfinite(history.history["loss"]).all(), policy


@pytest.mark.parametrize("policy", MIXED)
def test_a_float_input_of_token_ids_stays_exact_through_a_custom_layer(policy):
    class TokenEmbedding(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(20000, 4)

        def call(self, x):
            return self.embed(x) * 2.0

    kmp.set_policy(policy)
    ids = keras.Input((3,))  # float32 token ids, as in keras-io's examples
    layer = TokenEmbedding()
    model = keras.Model(ids, keras.layers.Dense(2)(layer(ids)))
    x = np.array([[19999.0, 19998.0, 3.0]], "float32")
    plain = keras.Model(ids, layer(ids))
    if policy == "mixed_bfloat16":  # plain Keras: 19999 -> 19968, silently
        rows = np.asarray(plain(x), "float32")
        np.testing.assert_array_equal(rows[0, 0], rows[0, 1])
    kmp.prepare(model)
    assert kmp.precision_report(model).row(layer.name).rule == planning.TOKEN_IDS
    assert layer.embed.compute_dtype == COMPUTE[policy]
    got = np.asarray(keras.Model(ids, layer(ids))(x), "float32")
    table = np.asarray(layer.embed.embeddings)
    np.testing.assert_allclose(got[0, 0], 2 * table[19999], rtol=1e-2)
    assert not np.allclose(got[0, 0], got[0, 1])
    assert dtype_of(layer(x)) == COMPUTE[policy]


def test_a_container_whose_output_would_change_keeps_casting_token_ids():
    class Mixed(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(100, 4)

        def call(self, x):
            return self.embed(x) + keras.ops.expand_dims(x, -1)  # uses x itself

    kmp.set_policy("mixed_bfloat16")
    ids = keras.Input((3,))
    layer = Mixed()
    model = kmp.prepare(keras.Model(ids, keras.layers.Dense(2)(layer(ids))))
    assert layer.compute_dtype == "bfloat16"
    assert (
        "would change what it returns"
        in kmp.planning.decisions.plan(model).decision(layer.name).note
    )


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


def test_predict_after_prepare_computes_with_the_policies_prepare_set():
    # A predict run before (a check right after loading) had traced the
    # old policies.
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="sigmoid")]
    )
    x = np.ones((2, 4), "float32")
    assert model.predict(x, verbose=0).dtype == np.float16
    kmp.prepare(model)  # the sigmoid output moves to float32
    assert model.layers[0].compute_dtype == "float32"
    assert model.predict(x, verbose=0).dtype == np.float32


def test_a_nested_models_predict_after_prepare_computes_with_the_new_policies():
    kmp.set_policy("mixed_float16")
    head = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="sigmoid")]
    )
    x = np.ones((2, 4), "float32")
    assert head.predict(x, verbose=0).dtype == np.float16
    inputs = keras.Input((4,))
    kmp.prepare(keras.Model(inputs, head(inputs)))  # its sigmoid: float32
    assert head.predict(x, verbose=0).dtype == np.float32


def test_prepare_rejects_non_models():
    with pytest.raises(TypeError, match="expects a Keras model"):
        kmp.prepare("model")


def test_plan_says_when_a_model_computes_in_float16():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, activation="sigmoid")]
    )
    assert not kmp.planning.decisions.plan(
        model
    ).computes_in_float16  # its only layer: a float32 sigmoid output
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)]
    )
    assert kmp.planning.decisions.plan(model).computes_in_float16
    assert not kmp.planning.decisions.plan(
        model, policy="mixed_bfloat16"
    ).computes_in_float16


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


# --- cases where a change would reach code that does not absorb it -------------


@pytest.mark.parametrize("policy", MIXED)
def test_a_softmax_whose_product_reaches_user_code_is_left_alone(policy):
    kmp.set_policy(policy)
    i = keras.Input((4,))
    h = keras.layers.Dense(4)(i)
    inner = keras.Model(i, h * keras.layers.Softmax(name="p")(h), name="inner")

    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="block")
            self.inner = inner

        def call(self, x):
            return x + self.inner(x)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(Block()(inputs)))
    kmp.prepare(model)
    assert inner.get_layer("p").compute_dtype == COMPUTE[policy]
    assert model.predict(np.ones((2, 4)), verbose=0).dtype == np.float32


def test_a_softmax_feeding_an_op_that_does_not_promote_is_left_alone():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4)(inputs)
    p = keras.layers.Softmax(name="p")(h)
    out = keras.layers.Dense(2)(keras.ops.slice_update(h, [0, 0], p))
    model = kmp.prepare(keras.Model(inputs, out))
    assert model.get_layer("p").compute_dtype == "bfloat16"
    note = kmp.planning.decisions.plan(model).decision("p").note
    assert "keras.ops SliceUpdate" in note
    model(np.ones((2, 4)))


def test_token_ids_rule_needs_a_trace_that_proves_the_output_unchanged():
    class Mixed(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(100, 4)

        def call(self, inputs):
            ids, features = inputs
            return self.embed(ids) + keras.ops.expand_dims(features, -1)

    kmp.set_policy("mixed_bfloat16")
    ids, features = keras.Input((3,)), keras.Input((3,))
    layer = Mixed()
    model = keras.Model([ids, features], keras.layers.Dense(2)(layer([ids, features])))
    kmp.prepare(model)
    assert layer.compute_dtype == "bfloat16"  # a list input: not traced, left
    model([np.ones((1, 3)), np.ones((1, 3))])


def test_token_ids_rule_planned_for_another_policy_traces_under_that_policy():
    class Mixed(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(100, 4)

        def call(self, x):
            return self.embed(x) + keras.ops.expand_dims(x, -1)

    ids = keras.Input((3,))
    layer = Mixed()
    model = keras.Model(ids, keras.layers.Dense(2)(layer(ids)))  # float32 model
    decision = kmp.planning.decisions.plan(model, policy="mixed_bfloat16").decision(
        layer.name
    )
    assert decision.rule != planning.TOKEN_IDS


@pytest.mark.parametrize("policy", MIXED)
def test_an_output_produced_through_ops_is_float32(policy):
    kmp.set_policy(policy)
    inputs = keras.Input((4,))
    value = keras.layers.Dense(1, name="value")(keras.layers.Dense(8)(inputs))
    model = kmp.prepare(keras.Model(inputs, keras.ops.squeeze(value, -1)))
    assert model.predict(np.ones((2, 4)), verbose=0).dtype == np.float32
    assert "16-bit output" not in kmp.debug.precision_audit(model).kinds()


def test_a_custom_output_layer_keeps_its_policy_large_or_small():
    class Body(keras.layers.Layer):
        def __init__(self, width, **kwargs):
            super().__init__(**kwargs)
            self.a = keras.layers.Dense(width)
            self.b = keras.layers.Dense(width)

        def call(self, x):
            return x + self.b(self.a(x))

    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((64,))
    body = Body(64, name="body")
    model = kmp.prepare(keras.Model(inputs, body(inputs)))
    assert body.a.compute_dtype == "bfloat16"  # mixed precision stays on
    assert "16-bit output" not in kmp.debug.precision_audit(model).kinds()
    assert model.predict(np.ones((1, 64)), verbose=0).dtype == np.float32
    head = Body(4, name="head")
    x = keras.layers.Dense(4)(keras.layers.Dense(64)(inputs))
    small = kmp.prepare(keras.Model(inputs, head(x)))
    assert head.a.compute_dtype == "bfloat16"
    assert small.predict(np.ones((1, 64)), verbose=0).dtype == np.float32
    # Where a train_step of the model's own receives it, kmp cannot cast it
    # there: the audit says how.

    class Stepped(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    head = Body(4, name="stepped_head")
    stepped = kmp.prepare(Stepped(inputs, head(x)))
    assert head.a.compute_dtype == "bfloat16"
    decision = kmp.planning.decisions.plan(stepped).decision("stepped_head")
    assert "training code receives" in decision.note
    [risk] = [
        r for r in kmp.debug.precision_audit(stepped) if r.kind == "16-bit output"
    ]
    assert risk.layer == "stepped_head"
    assert "kmp.set_layer_policy('name:stepped_head', 'float32')" in risk.fix


@pytest.mark.parametrize(
    "combine",
    [
        lambda y, scores: y * keras.ops.mean(scores),  # raw: raises on float32
        lambda y, scores: keras.ops.multiply(y, keras.ops.mean(scores)),  # promotes
    ],
    ids=["raw product", "keras.ops product"],
)
def test_returned_attention_scores_keep_their_dtype_in_user_code_under_float16(
    combine,
):
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="block")
            self.att = keras.layers.MultiHeadAttention(2, 4)

        def call(self, x):
            y, scores = self.att(x, x, return_attention_scores=True)
            return combine(y, scores)

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((5, 8))
    block = Block()
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(2)(block(inputs))))
    assert block.att.query_dense.compute_dtype == "float32"
    assert block.att._softmax.compute_dtype == "float16"
    softmax = f"block/{block.att.name}/{block.att._softmax.name}"
    decision = kmp.planning.decisions.plan(model).decision(softmax)
    assert decision.rule == planning.SCORES_KEPT
    assert f"kmp.set_layer_policy('name:{softmax}', 'float32')" in decision.note
    assert np.isfinite(model.predict(np.ones((2, 5, 8)), verbose=0)).all()


class AttentionBlock(keras.layers.Layer):
    """A transformer block's attention, called by user code (a raw residual
    add): kmp cannot see where what the attention returns goes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # dropout > 0: Keras computes the scores and calls its Softmax layer
        # (with no dropout and no scores returned it takes its fused path).
        self.att = keras.layers.MultiHeadAttention(4, 16, dropout=0.1)

    def call(self, x, training=None):
        return x + self.att(x, x, training=training)


@pytest.mark.parametrize(
    "policy, mode",
    [
        ("mixed_float16", "auto"),
        ("mixed_float16", "float32"),
        ("mixed_bfloat16", "float32"),
    ],
)
def test_attention_in_user_code_gets_a_float32_softmax_when_its_scores_stay_inside(
    policy, mode
):
    def model_under(policy):
        kmp.set_policy(policy)
        inputs = keras.Input((16, 64))
        block = AttentionBlock(name="block")
        return keras.Model(inputs, keras.layers.Dense(4)(block(inputs))), block

    compute = COMPUTE[policy]
    # Inputs the block's cast to the compute dtype leaves exact.
    x = np.random.RandomState(0).randn(2, 16, 64) * 256
    x = np.asarray(keras.ops.cast(keras.ops.cast(x, compute), "float32"))
    reference, ref_block = model_under("float32")
    query, key = ref_block.att.query_dense(x), ref_block.att.key_dense(x)
    logits = keras.ops.einsum("btnh,bsnh->bnts", query, key) / 4.0
    assert float(keras.ops.max(keras.ops.abs(logits))) > 65504  # overflow in float16
    kmp.rules.set_attention_scores(mode)
    model, block = model_under(policy)
    model.set_weights(reference.get_weights())
    kmp.planning.decisions.plan(
        model
    )  # traces the model under the plan, then restores it
    assert block.att._softmax.compute_dtype == compute
    kmp.prepare(model)
    y = np.asarray(model(x, training=False))
    assert np.isfinite(y).all()
    assert relative_error(y, reference(x, training=False)) < RELATIVE[compute]
    assert np.isfinite(np.asarray(model(x, training=True))).all()
    # The float32 scores reach a float32 softmax: nothing rounds them.
    softmax = block.att._softmax
    decision = kmp.planning.decisions.plan(model).decision(
        f"block/{block.att.name}/{softmax.name}"
    )
    assert decision.rule == planning.ATTENTION_SCORES
    assert softmax.compute_dtype == "float32"
    assert block.att.query_dense.compute_dtype == "float32"
    # Interfaces keep their dtype: the attention and the block return the
    # compute dtype, as before.
    assert dtype_of(block.att(x, x)) == compute
    assert dtype_of(block(x)) == compute


def test_a_sensitive_layer_before_a_layer_that_casts_inside_is_an_island():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((5, 4))
    x = keras.layers.Attention(name="att")([inputs, inputs])
    x = keras.layers.LayerNormalization()(x)
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(2)(x)))
    assert model.get_layer("att").compute_dtype == "float32"
