"""kmp.precision_report: the truth per layer, as data and as a table."""

import keras
import pytest

import kmp
from kmp import planning


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


def test_precision_report_is_data_and_a_table():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(small_cnn())
    report = kmp.precision_report(model)
    assert [row.path for row in report] == ["conv", "bn", "relu", "flat", "logits"]
    bn = report.row("bn")
    assert (bn.class_name, bn.compute_dtype, bn.variable_dtype, bn.returns) == (
        "BatchNormalization",
        "bfloat16",
        "float32",
        "bfloat16",
    )
    assert (bn.kind, bn.inside, bn.rule) == (
        "normalization",
        "float32 inside (Keras)",
        "policy",
    )
    assert report.row("logits").rule == planning.OUTPUT
    text = str(report)
    assert "mixed_bfloat16" in text.splitlines()[0]
    assert "float32 inside (Keras)" in text and "Outputs: float32" in text
    with pytest.raises(KeyError, match="Paths: conv"):
        report.row("missing")


def test_the_report_tells_computes_from_returns_for_attention_under_float16():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((6, 16))
    attention = keras.layers.MultiHeadAttention(2, 8, name="attn")
    model = keras.Model(inputs, keras.layers.Dense(2)(attention(inputs, inputs)))
    row = kmp.precision_report(kmp.prepare(model)).row("attn")
    assert (row.compute_dtype, row.returns) == ("float32", "float16")
    assert row.rule == planning.ATTENTION_SCORES


def test_report_before_prepare_says_so():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Softmax(name="p"), keras.layers.Dense(2)]
    )
    report = kmp.precision_report(model)
    assert report.row("p").compute_dtype == "float16"
    assert report.row("p").rule == "policy (kmp.prepare not applied)"


def test_report_without_trace_and_for_subclassed_models():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    report = kmp.precision_report(Net())
    assert "no input shapes" in report.not_traced and "Not traced" in str(report)
    untraced = kmp.precision_report(small_cnn(), trace=False)
    assert untraced.row("bn").returns == "" and untraced.outputs == ()


def test_report_rejects_non_models():
    with pytest.raises(TypeError, match="expects a Keras model"):
        kmp.precision_report("model")
