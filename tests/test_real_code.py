"""Code kmp did not write runs unchanged under kmp.compile: keras-io's text
Transformer as written there, residual blocks with raw `+` inside custom
layers, keras.applications models and KerasHub backbones (random weights,
no downloads). Under both mixed policies each trains with a finite loss
and returns float32 outputs."""

import importlib.util
import pathlib

import keras
import numpy as np
import pytest
from keras import layers
from keras import ops

import kmp

MIXED = ["mixed_float16", "mixed_bfloat16"]
COMPUTE = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


# keras-io's "Text classification with Transformer" (Apoorv Nandan), its two
# layers and its model as written there, live in benchmarks/ (registered for
# saving, so that `kmp bench` can load a file of it).
_spec = importlib.util.spec_from_file_location(
    "keras_io_text_transformer",
    pathlib.Path(__file__).resolve().parent.parent
    / "benchmarks"
    / "keras_io_text_transformer.py",
)
_keras_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_keras_io)
keras_io_text_transformer = _keras_io.keras_io_text_transformer


@pytest.mark.parametrize("policy", MIXED)
def test_keras_io_text_transformer_trains_under_kmp_compile(policy):
    kmp.set_policy(policy)
    model = keras_io_text_transformer(maxlen=40)
    kmp.compile(
        model,
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20000, (64, 40))  # ids up to 19999, as in IMDB
    y = rng.integers(0, 2, 64)
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # Called directly: predict would trace the whole model once more.
    assert keras.ops.convert_to_numpy(model(x[:4], training=False)).dtype == np.float32
    report = kmp.precision_report(model)
    block = next(r for r in report if r.class_name == "TransformerBlock")
    assert block.returns == COMPUTE[policy]
    norms = [r for r in report if r.class_name == "LayerNormalization"]
    assert {r.inside for r in norms} == {"float32 inside (Keras)"}


def test_keras_io_text_transformer_audit_does_not_recommend_breaking_it():
    kmp.set_policy("mixed_bfloat16")
    model = keras_io_text_transformer(maxlen=40)
    audit = kmp.debug.precision_audit(model)
    kinds = audit.kinds()
    # Before prepare: the float ids are rounded, and the softmax head is 16-bit.
    assert {"float token ids", "16-bit softmax"} <= kinds
    assert "19999 becomes 19968" in str(audit)
    kmp.prepare(model)
    # prepare fixes both without breaking the residuals in TransformerBlock.
    assert (
        not {"float token ids", "16-bit softmax", "16-bit output"}
        & kmp.debug.precision_audit(model).kinds()
    )
    model(np.zeros((2, 40)))


# --- residual blocks with raw `+` inside custom layers ------------------------


class PreLN(layers.Layer):
    def __init__(self, dim):
        super().__init__()
        self.norm = layers.LayerNormalization()
        self.dense = layers.Dense(dim)

    def call(self, x):
        return x + self.dense(self.norm(x))


class PostLN(layers.Layer):
    def __init__(self, dim):
        super().__init__()
        self.attn = layers.MultiHeadAttention(2, dim // 2)
        self.norm = layers.LayerNormalization()
        self.softmax_gate = layers.Softmax()

    def call(self, x):
        gate = self.softmax_gate(x)  # a raw product with a sensitive layer
        return self.norm(x + self.attn(x, x)) * gate


class BNResidual(layers.Layer):
    def __init__(self, dim):
        super().__init__()
        self.dense = layers.Dense(dim)
        self.bn = layers.BatchNormalization()

    def call(self, x, training=None):
        return x + self.bn(self.dense(x), training=training)


class ConvResidual(layers.Layer):
    def __init__(self, filters):
        super().__init__()
        self.conv = layers.Conv2D(filters, 3, padding="same")
        self.bn = layers.BatchNormalization()

    def call(self, x, training=None):
        return ops.relu(x + self.bn(self.conv(x), training=training))


def _sequence_model(block):
    inputs = keras.Input((6, 16))
    x = block(16)(inputs)
    x = block(16)(x)
    outputs = layers.Dense(1)(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, outputs)


def _image_model():
    inputs = keras.Input((8, 8, 4))
    x = ConvResidual(4)(inputs)
    x = ConvResidual(4)(x)
    outputs = layers.Dense(1)(layers.Flatten()(x))
    return keras.Model(inputs, outputs)


BLOCKS = {
    "pre-LN": lambda: _sequence_model(PreLN),
    "post-LN with attention": lambda: _sequence_model(PostLN),
    "BatchNormalization residual": lambda: _sequence_model(BNResidual),
    "convolution residual": _image_model,
}


@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("policy", MIXED)
def test_residual_blocks_with_raw_add_train_under_kmp_compile(block, policy):
    kmp.set_policy(policy)
    model = BLOCKS[block]()
    kmp.compile(model, optimizer="adam", loss="mse")
    shape = (16, *model.inputs[0].shape[1:])
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    history = model.fit(x, np.ones((16, 1)), batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # Its output keeps the compute dtype; Keras's loss casts it.
    assert keras.backend.standardize_dtype(model(x[:2]).dtype) == COMPUTE[policy]
    # Nothing a custom layer's code consumes was made to return another
    # dtype: every layer called by user code returns the compute dtype (the
    # query/key projections of Keras's attention are consumed by Keras's own
    # attention code, not by the user's).
    report = kmp.precision_report(model)
    plan = kmp.planning.decisions.plan(model)
    checked = 0
    for row in report:
        site = plan.decision(row.path).site
        if site.user_code is None or kmp.planning.decisions.is_keras_attention(
            site.parent
        ):
            continue
        if isinstance(site.layer, (layers.Dropout,)):
            continue  # not called in inference: nothing traced
        assert row.returns == COMPUTE[policy], row
        checked += 1
    assert checked >= 2


# --- keras.applications --------------------------------------------------------

# Each model under one policy, the policies taken in turn: kmp's plan for a
# model is the same under both (only the loss scaling differs), so every
# model and every policy still trains, at half the cost.
APPLICATIONS = [
    ("MobileNetV3Small", "mixed_float16"),
    ("EfficientNetB0", "mixed_bfloat16"),
    ("ConvNeXtTiny", "mixed_float16"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, policy", APPLICATIONS)
def test_keras_applications_train_under_kmp_compile(name, policy):
    kmp.set_policy(policy)
    model = getattr(keras.applications, name)(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    # One eager step: the same layers and dtypes as a traced step, in a
    # fraction of the time for models this size. The smallest model takes
    # the default (fused) update; for the two large ones, XLA's compilation
    # of an update over hundreds of variables would take longer than their
    # step (the fused update is compared with the unfused in test_fused.py).
    kmp.compile(
        model,
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        run_eagerly=True,
        fused_update=None if name == "MobileNetV3Small" else False,
    )
    x = np.random.default_rng(0).random((2, 32, 32, 3), "float32") * 255
    history = model.fit(x, np.array([1, 2]), batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # Called eagerly too: predict would trace the whole model once more.
    assert keras.ops.convert_to_numpy(model(x, training=False)).dtype == np.float32


# --- KerasHub ------------------------------------------------------------------

keras_hub = pytest.importorskip("keras_hub")
VOCAB = 64


def _causal_lm(name):
    # One decoder block each: every kind of layer the model has, half the
    # tracing.
    models = keras_hub.models
    if name == "gpt2":
        backbone = models.GPT2Backbone(
            vocabulary_size=VOCAB,
            num_layers=1,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=16,
        )
        return models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    config = dict(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
    )
    if name == "gemma":
        backbone = models.GemmaBackbone(head_dim=8, **config)
        return models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    backbone = models.LlamaBackbone(**config)
    return models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _tokens(n=8, length=12):
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(1, VOCAB, (n, length)).astype("int32"),
        "padding_mask": np.ones((n, length), "int32"),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, policy",
    # As for the applications: each model once, the policies in turn.
    [
        ("gpt2", "mixed_float16"),
        ("gemma", "mixed_bfloat16"),
        ("llama", "mixed_float16"),
    ],
)
def test_keras_hub_language_models_train_and_generate_under_kmp(name, policy):
    kmp.set_policy(policy)
    lm = _causal_lm(name)
    kmp.compile(
        lm,
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = _tokens()
    y = np.roll(x["token_ids"], -1, axis=1)
    history = lm.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert keras.ops.convert_to_numpy(lm(x, training=False)).dtype == np.float32
    prompt = {
        "token_ids": x["token_ids"][:2],
        "padding_mask": np.concatenate(
            [np.ones((2, 4), "int32"), np.zeros((2, 8), "int32")], axis=1
        ),
    }
    generated = lm.generate(prompt, max_length=12, stop_token_ids=None)
    assert generated["token_ids"].shape == (2, 12)


@pytest.mark.parametrize("policy", MIXED)
def test_keras_hub_layers_are_recognised_and_reported_truthfully(policy):
    kmp.set_policy(policy)
    compute = COMPUTE[policy]
    for name, norm, attention in (
        ("gemma", "RMSNormalization", "CachedGemmaAttention"),
        ("llama", "LlamaLayerNorm", "LlamaAttention"),
    ):
        lm = kmp.prepare(_causal_lm(name))
        report = kmp.precision_report(lm)
        norms = [r for r in report if r.class_name == norm]
        assert norms and {r.inside for r in norms} == {"float32 inside (KerasHub)"}
        assert {r.compute_dtype for r in norms} == {compute}
        assert {r.returns for r in norms} == {compute}
        attn = [r for r in report if r.class_name == attention]
        assert attn and {r.kind for r in attn} == {"attention"}
        assert all("float32 softmax inside" in r.inside for r in attn)
        # Its query x key product really runs in the compute dtype: the audit
        # says so, and does not pretend kmp can fix it from outside.
        audit = kmp.debug.precision_audit(lm)
        scores = [r for r in audit if r.kind == "16-bit attention scores"]
        assert {r.class_name for r in scores} == {attention}
        assert all(compute in r.detail for r in scores)
    gpt2 = kmp.prepare(_causal_lm("gpt2"))
    rows = [r for r in kmp.precision_report(gpt2) if r.class_name == "Softmax"]
    # CachedMultiHeadAttention's own call consumes its softmax: left as is.
    assert rows and all(r.compute_dtype == compute for r in rows)
    assert all("CachedMultiHeadAttention.call" in r.note for r in rows)
