"""The plan saved with the model (kmp.planning.saved): `model.save` keeps
the policies kmp gives the layers that a layer's own code creates, and
`keras.models.load_model` gives them back, with kmp or without it."""

import json

import keras
import numpy as np
import pytest
from processes import in_fresh_process

import kmp
from kmp.internals import keras_private
from kmp.planning import saved
from kmp.precision import quantization

keras_hub = pytest.importorskip("keras_hub")

X = np.random.default_rng(0).normal(size=(2, 4, 8)).astype("float32")


def attention_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    h = keras.layers.Dense(8, name="embed")(inputs)
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


@keras.saving.register_keras_serializable("kmp_tests")
class Block(keras.layers.Layer):
    """A custom layer whose code creates an attention layer with its dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(
            2, 4, name="attention", dtype=self.dtype_policy
        )

    def build(self, shape):
        self.attention.build(shape, shape)

    def call(self, x):
        return self.attention(x, x)

    def get_config(self):  # its own: Keras's automatic one holds no map
        return super().get_config()


def block_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4, 8)), Block(name="block"), keras.layers.Dense(3)]
    )


def attention_of(model):
    if isinstance(model, keras.Sequential):
        return model.layers[0].attention
    return model.get_layer("attention")


def llama():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def policies(layer) -> dict[str, str]:
    """{name: float policy} of `layer` and the layers inside it."""
    return {
        # A layer Keras never builds has no path, and may have an automatic
        # name ('softmax_1'): named by its class.
        inner.name if inner.path else type(inner).__name__: (
            quantization.float_part(inner)
        )
        for inner in keras_private.sublayers(layer, include_self=True)
    }


_LOAD = """
import json, sys
import numpy as np, keras
assert "keras_hub" not in sys.modules
import keras_hub  # registers KerasHub's classes, as a KerasHub user's script does

TOKENS = {"token_ids": np.ones((1, 4), "int32"), "padding_mask": np.ones((1, 4))}
found = {}
for name, path, x, y in json.loads(sys.argv[1]):
    model = keras.saving.load_model(path, compile=False)
    prediction = model.predict(TOKENS if x is None else np.load(x), verbose=0)
    np.save(y, np.asarray(prediction, "float32"))
    found[name] = {
        # By path; a layer Keras gives no path, by its name.
        "layers": {
            l.path or l.name: l.compute_dtype
            for l in model._flatten_layers()
            if not isinstance(l, keras.layers.InputLayer)
        },
        "weights": {w.path: w.dtype for w in model.weights},
        "policy": model.dtype_policy.name,
    }
found["kmp"] = "kmp" in sys.modules
print(json.dumps(found))
"""
TOKENS = {"token_ids": np.ones((1, 4), "int32"), "padding_mask": np.ones((1, 4))}


def test_plain_keras_loads_what_kmp_saves_and_exports(tmp_path):
    """Loaded without kmp: a float16 attention layer's float32 scores
    (query, key, softmax) beside its 16-bit value and output; a KerasHub
    model, whose task keeps its backbone's plain policy (Keras's compile
    reads its name); and kmp.export's 16-bit models of both. Dropout,
    which Keras never builds and so never gives a path, takes its attention
    layer's float32."""
    kmp.set_policy("mixed_float16")
    model = kmp.compile(attention_model(), optimizer="adam", loss="mse")
    model.fit(X, np.zeros((2, 4, 3)), verbose=0)
    model.save(tmp_path / "attention.keras")
    kmp.export(model, tmp_path / "attention16.keras", "float16")
    expected = model.predict(X, verbose=0)
    np.save(tmp_path / "x.npy", X)

    kmp.set_policy("mixed_bfloat16")
    lm = kmp.prepare(llama())
    # By path: the automatic names of layers with none ('dropout_2') differ
    # between processes.
    lm_layers = {
        layer.path: layer.compute_dtype
        for layer in lm._flatten_layers()
        if layer.path and not isinstance(layer, keras.layers.InputLayer)
    }
    lm.save(tmp_path / "lm.keras")
    kmp.export(lm, tmp_path / "lm16.keras")
    lm_expected = lm.predict(TOKENS, verbose=0)

    jobs = [
        (name, str(tmp_path / f"{name}.keras"), x, str(tmp_path / f"{name}.npy"))
        for name, x in [
            ("attention", str(tmp_path / "x.npy")),
            ("attention16", str(tmp_path / "x.npy")),
            ("lm", None),
            ("lm16", None),
        ]
    ]
    loaded = in_fresh_process(_LOAD, json.dumps(jobs))
    assert not loaded["kmp"]
    # The first softmax and dropout of the fresh process: named as such.
    assert {
        name: dtype
        for name, dtype in loaded["attention"]["layers"].items()
        if name.startswith("attention") or name in ("softmax", "dropout")
    } == {
        "attention": "float32",
        "attention/query": "float32",
        "attention/key": "float32",
        "attention/value": "float16",
        "softmax": "float32",
        "dropout": "float32",  # float16 in training: see the docstring
        "attention/attention_output": "float16",
    }
    np.testing.assert_allclose(
        np.load(tmp_path / "attention.npy"),
        expected,
        rtol=2**-9,  # the float32 dropout moves one float16 rounding
        atol=1e-3,
    )
    assert {path: loaded["lm"]["layers"].get(path) for path in lm_layers} == lm_layers
    assert loaded["lm"]["layers"]["attention_softmax"] == "float32"  # KerasHub's
    assert loaded["lm"]["policy"] == "mixed_bfloat16"
    # Another process may pick other kernels: one bfloat16 rounding apart.
    np.testing.assert_allclose(
        np.load(tmp_path / "lm.npy"), lm_expected, rtol=2**-7, atol=1e-4
    )

    # The exports: 16-bit weights, float32 where the plan computes in it.
    weights = loaded["attention16"]["weights"]
    assert weights["attention/query/kernel"] == "float32"
    assert weights["attention/value/kernel"] == "float16"
    assert weights["head/kernel"] == "float16"
    np.testing.assert_allclose(
        np.load(tmp_path / "attention16.npy"), expected, rtol=2**-8, atol=2e-3
    )
    assert set(loaded["lm16"]["weights"].values()) == {"bfloat16"}
    np.testing.assert_allclose(
        np.load(tmp_path / "lm16.npy"), lm_expected, rtol=2**-6, atol=0.02
    )


# Loaded, before kmp.prepare: the layers Keras gives no path take the
# default of the map they read. That is the attention layer's own float32
# where it saves the map; inside a custom layer, it is that layer's policy.
LOADED = {
    "attention_model": {"Softmax": "float32", "Dropout": "float32"},
    "block_model": {"Softmax": "mixed_float16", "Dropout": "mixed_float16"},
}


@pytest.mark.parametrize("build", [attention_model, block_model])
def test_a_model_loaded_with_kmp_plans_as_it_trained(build, tmp_path):
    """Loaded with kmp, the model's policies read as the plan saved them,
    and kmp.prepare gives back the split it trained with: a Functional
    model, and a Sequential one (whose name loading drops from the paths)
    holding a custom layer that creates an attention layer."""
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(build())
    trained = policies(attention_of(model))
    assert trained["query"] == trained["Softmax"] == "float32"
    assert trained["value"] == trained["Dropout"] == "mixed_float16"
    expected = model.predict(X, verbose=0)
    model.save(tmp_path / "m.keras")

    loaded = keras.saving.load_model(tmp_path / "m.keras")
    attention = attention_of(loaded)
    assert policies(attention) == dict(trained, **LOADED[build.__name__])
    kmp.prepare(loaded)
    assert policies(attention) == trained
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), expected, rtol=2**-11, atol=1e-6
    )


def test_the_saved_map_follows_the_plan():
    """kmp writes the map once, updates it in place when the plan changes,
    and leaves the model's own policy plain (Keras's compile reads it)."""
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(attention_model())
    attention = model.get_layer("attention")
    first = saved.entries(attention)
    assert first == {
        "(?:.*/)?attention/attention_output": "mixed_float16",
        "(?:.*/)?attention/value": "mixed_float16",
    }
    held = attention.dtype_policy
    kmp.prepare(model)
    assert attention.dtype_policy is held and saved.entries(attention) == first

    kmp.set_layer_policy("name:attention/value", "float32")
    kmp.prepare(model)
    assert attention.dtype_policy is held
    assert saved.entries(attention) == {
        "(?:.*/)?attention/attention_output": "mixed_float16"
    }
    kmp.set_layer_policy("name:attention/value", None)
    kmp.prepare(model)
    assert saved.entries(attention) == first
    assert model.dtype_policy.name == "mixed_float16"
    assert attention.compute_dtype == "float32"
    assert policies(attention)["value"] == "mixed_float16"


@keras.saving.register_keras_serializable("kmp_tests")
class Dense2(keras.layers.Layer):
    """A custom layer whose sublayers keep its policy: it needs no map."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="dense", dtype=self.dtype_policy)

    def build(self, shape):
        self.dense.build(shape)

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return super().get_config()


@keras.saving.register_keras_serializable("kmp_tests")
class AutoBlock(Block):
    """Block with Keras's automatic config (no get_config of its own)."""

    get_config = keras.layers.Layer.get_config


def test_each_layer_that_needs_a_map_gets_one_and_loads_saves_again(tmp_path):
    """A layer that needs no map leaves the next one's map written (both
    hold Keras's global policy object); a layer with Keras's automatic
    config gets none (loaded with one, it could not be saved again); a
    loaded model saves again."""
    kmp.set_policy("mixed_bfloat16")
    kmp.set_layer_policy("name:attention/value", "float32")
    kmp.set_layer_policy("name:auto/attention/value", "float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    h = Dense2(name="plain")(inputs)
    attention = keras.layers.MultiHeadAttention(2, 4, name="attention")
    h = attention(h, h)
    auto = AutoBlock(name="auto")
    model = kmp.prepare(keras.Model(inputs, auto(h)))
    assert model.get_layer("plain").dtype_policy is keras.config.dtype_policy()
    assert saved.entries(model.get_layer("plain")) == {}
    assert saved.entries(attention) == {"(?:.*/)?attention/value": "float32"}
    assert saved.entries(auto) == {}
    assert auto.attention.value_dense.compute_dtype == "float32"  # live
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    loaded.save(tmp_path / "again.keras")
    again = keras.saving.load_model(tmp_path / "again.keras")
    assert again.get_layer("attention").value_dense.compute_dtype == "float32"


def test_a_model_inside_the_model_keeps_a_plain_policy(tmp_path):
    """A KerasHub task takes its backbone's policy when it is loaded, and
    Keras's compile reads it by name to scale the loss under float16: a
    backbone with a rule inside keeps its plain policy (the rule is not
    saved; kmp.compile applies it again)."""
    kmp.set_policy("mixed_float16")
    kmp.set_layer_policy("name:feedforward_gate_dense", "float32")
    lm = kmp.prepare(llama())
    gate = lm.backbone.get_layer("transformer_layer_0")._feedforward_gate_dense
    assert gate.compute_dtype == "float32"
    assert lm.backbone.dtype_policy.name == "mixed_float16"
    lm.save(tmp_path / "lm.keras")
    loaded = keras.saving.load_model(tmp_path / "lm.keras")
    assert loaded.dtype_policy.name == "mixed_float16"
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
