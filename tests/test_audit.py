"""kmp.debug.precision_audit (kmp.audit): the risks it names, and the
fixes it gives."""

import keras
import numpy as np
import pytest

import kmp


def test_precision_audit_finds_each_kind_of_risk_before_a_switch():
    class Halve(keras.layers.Layer):
        def call(self, x):
            import tensorflow as tf

            return x * tf.constant(0.5)  # a float32 constant: fails on float16

    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(12, name="odd"),
            keras.layers.Dense(16, name="even"),
            Halve(name="halve"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Softmax(name="probs"),
            keras.layers.Dense(8, activation="sigmoid", name="head"),
        ]
    )
    assert len(kmp.debug.precision_audit(model)) == 0  # fine in float32
    report = kmp.debug.precision_audit(model, policy="mixed_float16")
    by_layer = {(r.layer, r.kind) for r in report}
    assert ("odd", "size not a multiple of 8") in by_layer
    assert ("even", "size not a multiple of 8") in by_layer  # its input is 12
    assert ("halve", "dtype error") in by_layer
    assert ("probs", "16-bit softmax") in by_layer
    assert ("head", "16-bit output") in by_layer
    # Keras's LayerNormalization computes in float32 inside: not a risk.
    assert not any(layer == "norm" for layer, _ in by_layer)
    assert "keras.ops.cast" in str(report)
    assert model.get_layer("halve").compute_dtype == "float32"  # restored


def test_precision_audit_is_clean_for_a_prepared_float32_model():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)])
    assert len(kmp.debug.precision_audit(model)) == 0  # float32: no 16-bit risks


class RawAttention(keras.layers.Layer):
    """A user's attention: scores and softmax in the compute dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.q = keras.layers.Dense(8)
        self.k = keras.layers.Dense(8)

    def call(self, x):
        scores = keras.ops.einsum("btd,bsd->bts", self.q(x), self.k(x))
        return keras.ops.einsum("bts,bsd->btd", keras.ops.softmax(scores), x)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_precision_audit_names_16bit_scores_and_softmax_in_a_custom_layer(policy):
    kmp.set_policy(policy)
    inputs = keras.Input((6, 8))
    x = RawAttention(name="raw")(inputs)
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(2)(x)))
    audit = kmp.debug.precision_audit(model)
    by_kind = {r.kind: r for r in audit if r.layer == "raw"}
    assert {"16-bit attention scores", "16-bit softmax"} <= set(by_kind)
    compute = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}[policy]
    assert compute in by_kind["16-bit attention scores"].detail
    assert "RawAttention.call" in by_kind["16-bit attention scores"].fix
    assert "kmp.prepare" not in by_kind["16-bit softmax"].fix


def test_precision_audit_names_a_softmax_kmp_must_leave_inside_user_code():
    class Gated(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.gate = keras.layers.Softmax()

        def call(self, x):
            return x * self.gate(x)  # a float32 gate would break this product

    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((8,))
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(2)(Gated()(inputs))))
    risks = [r for r in kmp.debug.precision_audit(model) if r.kind == "16-bit softmax"]
    assert len(risks) == 1 and "Gated.call" in risks[0].detail
    assert "Softmax(..., dtype='float32')" in risks[0].fix
    assert "keras.ops.cast(y, x.dtype)" in risks[0].fix


def test_precision_audit_follows_user_rules():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Softmax(name="p"), keras.layers.Dense(8)]
    )
    assert "16-bit softmax" in kmp.debug.precision_audit(model).kinds()
    kmp.set_layer_policy("name:p", "mixed_float16")  # the user keeps it 16-bit
    assert "16-bit softmax" not in kmp.debug.precision_audit(model).kinds()


def test_a_subclassed_model_is_flagged_only_when_its_own_step_gets_16bit():
    class Net(keras.Model):
        def __init__(self, cast):
            super().__init__()
            self.d = keras.layers.Dense(2)
            self.cast = cast

        def call(self, x):
            y = self.d(x)
            return keras.ops.cast(y, "float32") if self.cast else y

    class Stepped(Net):
        def train_step(self, data):
            return super().train_step(data)

    kmp.set_policy("mixed_bfloat16")
    # Keras's own train_step hands the outputs to its loss, which casts them.
    cases = ((Stepped, False, True), (Stepped, True, False), (Net, False, False))
    for cls, cast, flagged in cases:
        net = cls(cast)
        net(np.ones((2, 4)))
        audit = kmp.debug.precision_audit(net)
        assert ("16-bit output" in audit.kinds()) is flagged
        assert audit.not_traced == ""


def test_keras_attention_before_prepare_is_named_once_with_the_prepare_fix():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((5, 8))
    x = keras.layers.Attention(name="att")([inputs, inputs])
    model = keras.Model(inputs, keras.layers.Dense(8)(x))
    risks = [r for r in kmp.debug.precision_audit(model) if r.layer == "att"]
    assert [r.kind for r in risks] == ["16-bit attention"]
    assert "kmp.prepare" in risks[0].fix


def test_group_query_attention_gets_the_scores_mode_fix():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((6, 16))
    gqa = keras.layers.GroupQueryAttention(8, 4, 2, name="gqa")
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(8)(gqa(inputs, inputs))))
    risk = next(r for r in kmp.debug.precision_audit(model) if r.layer == "gqa")
    assert risk.kind == "16-bit attention scores"
    assert "set_attention_scores('float32')" in risk.fix
    kmp.rules.set_attention_scores("compute")
    kmp.set_policy("mixed_float16")
    gqa16 = keras.layers.GroupQueryAttention(8, 4, 2, name="gqa16")
    model = kmp.prepare(
        keras.Model(inputs, keras.layers.Dense(8)(gqa16(inputs, inputs)))
    )
    risk = next(r for r in kmp.debug.precision_audit(model) if r.layer == "gqa16")
    assert "set_attention_scores('compute')" in risk.detail


def test_a_keras_layer_left_16bit_in_user_code_gets_a_fix_that_keeps_its_math():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm = keras.layers.UnitNormalization()

        def call(self, x):
            return x + self.norm(x)

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((8,))
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(2)(Block()(inputs))))
    risk = next(
        r
        for r in kmp.debug.precision_audit(model)
        if r.kind.startswith("16-bit normalization")
    )
    assert "dtype='float32'" in risk.fix and "Block.call" in risk.fix
    assert "LayerNormalization" not in risk.fix


def test_float_token_ids_rounded_by_a_layer_before_the_embedding_are_named():
    ids = keras.Input((6,))
    x = keras.layers.Reshape((6,))(ids)  # casts the float ids to 16-bit
    x = keras.layers.Embedding(5000, 8, name="embed")(x)
    model = keras.Model(ids, keras.layers.Dense(2)(x))
    risk = next(
        r
        for r in kmp.debug.precision_audit(model, policy="mixed_bfloat16")
        if r.kind == "float token ids"
    )
    assert risk.layer == "embed" and risk.class_name == "Reshape"
    assert "4999 becomes 4992" in risk.detail  # bfloat16's rounding of 4999


def test_an_unbuilt_model_is_audited_and_reported_without_a_trace():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])
    audit = kmp.debug.precision_audit(model)
    assert "not built" in audit.not_traced
    # What could not be checked comes first, with what to do; never "No
    # precision risks found" about the model.
    first = str(audit).splitlines()[0]
    assert first.startswith("Could not check all of") and "Build it first" in first
    assert "No precision risks found in 'sequential" not in str(audit)
    report = kmp.precision_report(model)
    assert "not built" in report.not_traced
