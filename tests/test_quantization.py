"""Quantized (int8, int4, float8) and LoRA models under kmp's policies."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.scaling import lora

MIXED = ["mixed_bfloat16", "mixed_float16"]
MODES = ["int8", "int4", "float8"]


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, (x[:, :4] * 0.5).astype("float32")


def dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="dense"),
            keras.layers.EinsumDense("ab,bc->ac", output_shape=32, name="einsum"),
            keras.layers.Dense(4, name="head"),
        ],
        name="quantized",
    )


def quietly_quantize(model, mode, **kwargs):
    with warnings.catch_warnings():  # "InputLayer has no quantize method"
        warnings.simplefilter("ignore", UserWarning)
        model.quantize(mode, **kwargs)


def combinations():
    for policy in MIXED:
        for mode in MODES:
            if (mode, policy) != ("int8", "mixed_float16"):  # Keras refuses
                yield policy, mode


@pytest.mark.parametrize("policy,mode", list(combinations()))
def test_quantized_models_compile_report_and_train(policy, mode):
    kmp.set_policy(policy)
    model = dense_model()
    quietly_quantize(model, mode)
    kmp.compile(model, optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    report = kmp.precision_report(model)
    compute = kmp.get_policy().compute_dtype
    assert [(r.path, r.quantization, r.compute_dtype) for r in report] == [
        ("dense", mode, compute),
        ("einsum", mode, compute),
        ("head", mode, compute),  # the output is cast where it is handed on
    ]
    assert model.get_layer("head").quantization_mode == mode  # not undone
    header = str(report).splitlines()[1].split()
    assert header[3:6] == ["quantized", "LoRA", "trains"]
    x, y = data()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # The telemetry joins the logs of a quantized model (Model.quantize
    # leaves the model's state locked).
    assert "skipped_steps" in history.history
    assert ("loss_scale" in history.history) == (policy == "mixed_float16")


def test_the_output_rule_keeps_the_quantization_settings():
    kmp.set_policy("mixed_bfloat16")
    model = dense_model()
    float8 = keras.dtype_policies.QuantizedFloat8DTypePolicy(
        "float8", "mixed_bfloat16", amax_history_length=16
    )
    head = keras.layers.Dense(4, name="head", dtype=float8, activation="sigmoid")
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, name="dense"), head]
    )
    quietly_quantize(
        model,
        "int4",
        config=keras.quantizers.Int4QuantizationConfig(block_size=8),
        filters=["dense"],
    )
    assert head.quantization_mode == "float8"  # precondition: a float8 head
    kmp.prepare(model)
    assert head.dtype_policy.name == "float8_from_float32"
    assert head.dtype_policy.amax_history_length == 16
    assert model.get_layer("dense").dtype_policy.name == "int4/8_from_mixed_bfloat16"
    before = [layer.dtype_policy for layer in model.layers]
    kmp.prepare(model)  # idempotent: nothing left to change
    assert [layer.dtype_policy for layer in model.layers] == before


def test_the_float_part_survives_a_keras_hub_get_config():
    # KerasHub's Backbone.get_config (every save) sets the live policies'
    # names to None through DTypePolicyMap.get_config.
    kmp.set_policy("mixed_bfloat16")
    lm = _llama()
    quietly_quantize(lm, "int4")
    kmp.prepare(lm)

    def rows():
        report = kmp.precision_report(lm, trace=False)
        return [(r.path, r.quantization, r.compute_dtype, r.rule) for r in report]

    before = rows()
    assert any(q == "int4" and c == "bfloat16" for _, q, c, _ in before)
    lm.get_config()
    assert rows() == before  # not 'explicit dtype=', not another dtype


def test_the_audit_leaves_a_policy_map_as_it_was():
    kmp.set_policy("mixed_bfloat16")
    lm = _llama()
    quietly_quantize(lm, "int8")
    rebuilt = keras_hub.models.LlamaCausalLM.from_config(lm.get_config())
    entries = dict(rebuilt.backbone.dtype_policy.items())
    kmp.debug.precision_audit(rebuilt, policy="mixed_float16")
    assert dict(rebuilt.backbone.dtype_policy.items()).keys() == entries.keys()


def test_int8_layers_are_kept_out_of_float16_with_the_reason_and_the_fix():
    # Keras refuses model.quantize("int8") under float16: quantized under
    # float32 and planned for mixed_float16, the int8 layers stay float32.
    kmp.set_policy("float32")
    model = dense_model()
    quietly_quantize(model, "int8")
    the_plan = kmp.planning.decisions.plan(model, policy="mixed_float16")
    dense = the_plan.decision("dense")
    assert dense.policy.compute_dtype == "float32"
    assert dense.rule == "int8: kept in float32"
    assert "int4 or float8" in dense.note
    audit = kmp.debug.precision_audit(model, policy="mixed_float16")
    assert "int8 kept out of float16" in audit.kinds()
    assert "mixed_bfloat16" in str(audit)
    # The audit restored every layer's policy.
    assert [layer.dtype_policy.name for layer in model.layers] == [
        "int8_from_float32"
    ] * 3


def test_int4_layers_under_float16_need_no_such_exception():
    kmp.set_policy("float32")
    model = dense_model()
    quietly_quantize(model, "int4")
    decision = kmp.planning.decisions.plan(model, policy="mixed_float16").decision(
        "dense"
    )
    assert decision.policy.compute_dtype == "float16"


@pytest.mark.parametrize("policy", MIXED)
def test_lora_trains_the_adapters_with_loss_scaling_and_leaves_the_base_bit_for_bit(
    policy,
):
    kmp.set_policy(policy)
    model = dense_model()
    if policy == "mixed_bfloat16":
        quietly_quantize(model, "int8", filters=["dense"])
    model.get_layer("dense").enable_lora(4)
    model.get_layer("einsum").enable_lora(2)
    kmp.compile(model, optimizer=keras.optimizers.AdamW(1e-2), loss="mse")
    assert model.optimizer.mode == ("dynamic" if policy == "mixed_float16" else "none")
    report = kmp.precision_report(model)
    assert report.row("dense").lora_rank == 4
    assert report.row("einsum").lora_rank == 2
    assert report.row("einsum").trains == "adapters"
    assert report.row("head").trains == "yes"
    frozen = {w.path: w.numpy().copy() for w in model.non_trainable_weights}
    adapters = {
        w.path: w.numpy().copy() for w in model.trainable_weights if "lora" in w.path
    }
    assert frozen and len(adapters) == 4
    x, y = data()
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    for w in model.non_trainable_weights:
        if w.path in frozen:
            np.testing.assert_array_equal(w.numpy(), frozen[w.path], err_msg=w.path)
    for w in model.trainable_weights:
        if w.path in adapters:
            assert not np.array_equal(w.numpy(), adapters[w.path]), w.path


# --- float8 training: its scale and amax-history variables ---------------------


def _float8_model():
    model = dense_model()
    quietly_quantize(model, "float8")
    return model


def _float8_state(model):
    return {
        w.path: w.numpy()
        for w in model.weights
        if "scale" in w.path or "amax_history" in w.path
    }


def _train(model, optimizer, path, steps=6):
    x, y = data(8 * steps)
    if path == "fit":
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return
    optimizer.build(model.trainable_variables)
    scaled = isinstance(optimizer, kmp.LossScaleOptimizer)
    stated = {"scaled": False} if scaled else {}

    @tf.function
    def step(x, y):
        tape = kmp.ScaledGradientTape(optimizer) if scaled else tf.GradientTape()
        with tape:
            pred = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_mean(tf.square(pred - y))
        grads = tape.gradient(loss, model.trainable_variables)
        # The tape's gradients are unscaled: stated (a plain optimizer takes them).
        optimizer.apply(grads, model.trainable_variables, **stated)

    for i in range(steps):
        step(x[8 * i : 8 * (i + 1)], y[8 * i : 8 * (i + 1)])


@pytest.mark.parametrize(
    "policy,path",
    [
        ("mixed_float16", "fit"),
        ("mixed_float16", "tape"),
        ("mixed_float16", "accumulation"),
        ("mixed_bfloat16", "tape"),  # the wrapper scales under bfloat16 too
    ],
)
def test_float8_training_matches_training_without_loss_scaling(policy, path):
    # The reference: the same training in float32, without loss scaling.
    # (Plain float16 is no reference: there Keras's float8 gradient scale
    # comes out about 30 times its float32 value on this model.)
    accumulate = {"gradient_accumulation_steps": 2} if path == "accumulation" else {}
    loop = "tape" if path == "tape" else "fit"
    kmp.set_policy("float32")
    plain = _float8_model()
    _train(plain, keras.optimizers.SGD(0.05, **accumulate), loop)
    kmp.set_policy(policy)
    scaled = _float8_model()
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, **accumulate), mode="dynamic", initial_scale=1024
    )
    _train(scaled, optimizer, loop)
    assert int(optimizer.skipped_steps_total) == 0
    assert float(optimizer.loss_scale) == 1024  # no overflow, no growth yet
    expected, got = _float8_state(plain), _float8_state(scaled)
    assert expected and expected.keys() == got.keys()
    for name, value in got.items():
        assert np.isfinite(value).all(), name
        # The forward scales (inputs, kernel) are those of unscaled training;
        # the backward one follows the gradient it quantizes, which is the
        # scaled one: 1024 times larger (divided by the scale, a wrong one
        # would be 1024 times smaller).
        # Within a factor 2 of the reference (16-bit rounding moves single
        # amax entries by ~15%); a mis-scaled one is 1024 times off.
        factor = 1024.0 if "grad" in name else 1.0  # scale and amax history
        ratio = np.abs(value).max() / (np.abs(expected[name]).max() * factor)
        assert 0.5 < ratio < 2.0, (name, ratio)
    weights = [
        (a, b)
        for a, b in zip(plain.trainable_weights, scaled.trainable_weights, strict=True)
        if a.path not in expected
    ]
    assert weights
    for a, b in weights:
        np.testing.assert_allclose(
            b.numpy(), a.numpy(), rtol=5e-2, atol=5e-3, err_msg=a.path
        )


# --- saving a quantized LoRA model -----------------------------------------------


def _lora_model(policy, mode):
    kmp.set_policy(policy)
    model = dense_model()
    quietly_quantize(model, mode)
    model.get_layer("dense").enable_lora(4)
    model.get_layer("einsum").enable_lora(4)
    kmp.compile(model, optimizer=keras.optimizers.AdamW(1e-2), loss="mse")
    return model


def _values(variables):
    return [keras.ops.convert_to_numpy(v) for v in variables]


@pytest.mark.parametrize(
    "policy,mode", [("mixed_bfloat16", "int8"), ("mixed_float16", "int4")]
)
def test_a_checkpoint_round_trip_continues_training_bit_identically(
    policy, mode, tmp_path
):
    x, y = data()
    model = _lora_model(policy, mode)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        tmp_path / "ckpt"
    )
    restored = _lora_model(policy, mode)
    restored.optimizer.build(restored.trainable_variables)
    status = tf.train.Checkpoint(model=restored, optimizer=restored.optimizer)
    status.restore(path).assert_existing_objects_matched()
    state = model.weights + model.optimizer.variables
    again = restored.weights + restored.optimizer.variables
    for a, b in zip(_values(state), _values(again), strict=True):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(_values(model.weights), _values(restored.weights), strict=True):
        np.testing.assert_array_equal(a, b)


def test_adapters_zeroed_by_a_keras_file_round_trip_are_named_before_training(
    tmp_path,
):
    # Keras's .keras format merges LoRA into the kernel on save and zeroes
    # both factors on load: the adapters would silently never train again.
    x, y = data()
    model = _lora_model("mixed_bfloat16", "int8")
    model.fit(x, y, batch_size=8, verbose=0)
    model.save(tmp_path / "lora.keras")
    loaded = keras.models.load_model(tmp_path / "lora.keras")
    adapters = [w for w in loaded.trainable_weights if "lora_kernel" in w.path]
    assert adapters and all(not np.any(w.numpy()) for w in adapters)  # Keras's
    with pytest.warns(UserWarning, match=r"adapters of .*dense.* cannot learn"):
        loaded.fit(x, y, batch_size=8, verbose=0)


def test_freshly_enabled_adapters_raise_no_such_warning():
    x, y = data()
    model = _lora_model("mixed_bfloat16", "int4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=8, verbose=0)


# --- a KerasHub language model, int4 and LoRA --------------------------------------

keras_hub = pytest.importorskip("keras_hub")
VOCAB = 64


def _llama():
    # One decoder block: every kind of layer a Llama has, half the tracing.
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.slow
# The loss-scaled policy: int4 and LoRA under bfloat16 train in
# test_quantized_models_compile_report_and_train and the LoRA test above.
@pytest.mark.parametrize("policy", ["mixed_float16"])
def test_a_keras_hub_llama_with_int4_and_lora_compiles_reports_and_trains(policy):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    lm = _llama()
    quietly_quantize(lm, "int4")
    lm.backbone.enable_lora(4)
    kmp.compile(
        lm,
        optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    report = kmp.precision_report(lm)
    lora = [r for r in report if r.lora_rank]
    assert lora and all(r.lora_rank == 4 for r in lora)
    assert all(r.quantization == "int4" and r.trains == "adapters" for r in lora)
    assert {"query", "value"} == {r.path.rsplit("/", 1)[-1] for r in lora}
    assert any(r.quantization == "int4" and r.trains == "no" for r in report)
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, VOCAB, (8, 12)).astype("int32"),
        "padding_mask": np.ones((8, 12), "int32"),
    }
    y = np.roll(x["token_ids"], -1, axis=1)
    frozen = {w.path: w.numpy().copy() for w in lm.non_trainable_weights}
    history = lm.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert ("loss_scale" in history.history) == (policy == "mixed_float16")
    for w in lm.non_trainable_weights:
        if w.path in frozen and "amax" not in w.path:
            np.testing.assert_array_equal(w.numpy(), frozen[w.path], err_msg=w.path)


class _Tokens:
    """GPTQ and AWQ configs want a tokenizer; given token arrays they do
    not call it."""

    def tokenize(self, text):
        raise AssertionError("not called for token arrays")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrated_quantizations_compile_and_report(mode):
    kmp.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    lm = _llama()
    config_class = {
        "gptq": keras.quantizers.GPTQConfig,
        "awq": keras.quantizers.AWQConfig,
    }[mode]
    config = config_class(
        dataset=[np.arange(64) % VOCAB],
        tokenizer=_Tokens(),
        num_samples=2,
        sequence_length=8,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        lm.quantize(mode, config=config)
    kmp.compile(
        lm,
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    report = kmp.precision_report(lm)
    assert mode in {r.quantization for r in report}
    assert not report.not_traced  # the calibrated layers trace


def test_trains_counts_weights_not_quantization_parameters():
    kmp.set_policy("mixed_bfloat16")
    model = dense_model()
    quietly_quantize(model, "float8", filters=["dense"])
    model.get_layer("dense").enable_lora(2)  # float8 scales: overwritten, not trained
    quietly_quantize(model, "int8", filters=["einsum"])
    report = kmp.precision_report(model, trace=False)
    assert report.row("dense").trains == "adapters"
    assert report.row("einsum").trains == "no"  # int8 kernel frozen, no bias


def test_dead_adapters_are_found_for_embeddings_too():
    embedding = keras.layers.Embedding(10, 4, name="tokens")
    embedding.build((None,))
    embedding.enable_lora(2)
    assert lora.dead_adapters(embedding.trainable_weights) == []
    for w in embedding.trainable_weights:
        w.assign(np.zeros(w.shape, "float32"))
    assert lora.dead_adapters(embedding.trainable_weights) == ["tokens"]
