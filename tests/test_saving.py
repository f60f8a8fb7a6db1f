"""The plan saved with the model (kmp.planning.saved): `model.save` keeps
the policies kmp gives the layers that a layer's own code creates, and
`keras.models.load_model` gives them back, with kmp or without it."""

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

attention = keras.saving.load_model(sys.argv[1], compile=False)
lm = keras.saving.load_model(sys.argv[2], compile=False)
prediction = attention.predict(np.load(sys.argv[3]), verbose=0)
np.save(sys.argv[4], np.asarray(prediction, "float32"))
tokens = {"token_ids": np.ones((1, 4), "int32"), "padding_mask": np.ones((1, 4))}
np.save(sys.argv[5], np.asarray(lm.predict(tokens, verbose=0), "float32"))
print(json.dumps({
    "kmp": "kmp" in sys.modules,
    "attention": {
        layer.name: layer.compute_dtype
        for layer in attention.get_layer("attention")._flatten_layers()
    },
    "lm": {
        layer.name: layer.compute_dtype
        for layer in lm.backbone._flatten_layers()
    },
}))
"""


def test_plain_keras_loads_the_precision_kmp_trained_with(tmp_path):
    """A float16 attention layer's float32 scores (query, key, softmax) and
    16-bit value and output, and a rule inside a KerasHub backbone, load
    without kmp. Dropout, which Keras never builds and so never gives a
    path, takes its attention layer's float32."""
    kmp.set_policy("mixed_float16")
    model = kmp.compile(attention_model(), optimizer="adam", loss="mse")
    model.fit(X, np.zeros((2, 4, 3)), verbose=0)
    model.save(tmp_path / "attention.keras")

    kmp.set_policy("mixed_bfloat16")
    kmp.set_layer_policy("name:feedforward_gate_dense", "float32")
    lm = kmp.prepare(llama())
    lm.save(tmp_path / "lm.keras")
    tokens = {"token_ids": np.ones((1, 4), "int32"), "padding_mask": np.ones((1, 4))}
    lm_expected = lm.predict(tokens, verbose=0)
    np.save(tmp_path / "x.npy", X)

    paths = [tmp_path / name for name in ("attention.keras", "lm.keras", "x.npy")]
    paths += [tmp_path / "y.npy", tmp_path / "lm_y.npy"]
    loaded = in_fresh_process(_LOAD, *map(str, paths))
    assert not loaded["kmp"]
    assert loaded["attention"] == {
        "attention": "float32",
        "query": "float32",
        "key": "float32",
        "value": "float16",
        "softmax": "float32",
        "dropout": "float32",  # float16 in training: see the docstring
        "attention_output": "float16",
    }
    assert loaded["lm"]["feedforward_gate_dense"] == "float32"
    assert loaded["lm"]["feedforward_intermediate_dense"] == "bfloat16"
    assert loaded["lm"]["attention_softmax"] == "float32"  # KerasHub's own
    np.testing.assert_allclose(
        np.load(tmp_path / "y.npy"),
        model.predict(X, verbose=0),
        rtol=2**-9,  # the float32 dropout moves one float16 rounding
        atol=1e-3,
    )
    np.testing.assert_array_equal(np.load(tmp_path / "lm_y.npy"), lm_expected)


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
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), expected)


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
