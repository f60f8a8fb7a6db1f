"""kmp.precision_report: the truth per layer, as data and as a table."""

import keras
import pytest

import kmp
from kmp.backend import machine
from kmp.planning import decisions as planning


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
    assert "float32 inside (Keras)" in text and "Outputs: bfloat16" in text
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


CPU_ONLY = machine.Capabilities(machine.CPUInfo("test cpu", 2, frozenset()), (), 0)
WITH_GPU = machine.Capabilities(
    machine.CPUInfo("test cpu", 2, frozenset()),
    (machine.GPUInfo("A100", (8, 0)),),
    0,
)


def mlp():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)]
    )


def test_the_report_states_the_process_wide_remapper_setting_on_a_cpu(monkeypatch):
    monkeypatch.setattr(machine, "capabilities", lambda: CPU_ONLY)
    kmp.set_policy("mixed_float16")
    half = kmp.compile(mlp(), optimizer="sgd", loss="mse")
    note = kmp.precision_report(half).remapper
    assert note.startswith("Grappler remapping: off now, for every model")
    assert "process-wide" in note and "changes it for both" in note
    assert "separate processes" in note and "kmp.set_policy('mixed_float16')" in note
    assert note in str(kmp.precision_report(half)).replace("\n", " ")
    # A float32 model compiled after it turns the remapper on, for both.
    with kmp.policy_scope("float32"):
        single = mlp()
    kmp.compile(single, optimizer="sgd", loss="mse")
    note = kmp.precision_report(half).remapper
    assert note.startswith("Grappler remapping: ON now")
    assert "kmp.compile (for float32)" in note
    assert "~50x slower" in note and "kmp.set_policy('mixed_float16')" in note
    assert kmp.precision_report(single).remapper == ""  # on: what it wants
    # Back to float16: now the float32 model trains with the remapper off.
    kmp.set_policy("mixed_float16")
    note = kmp.precision_report(single).remapper
    assert note.startswith("Grappler remapping: off now") and "process-wide" in note
    assert "kmp.set_policy('float32')" in note


def test_the_report_is_silent_on_the_remapper_where_it_does_not_apply(monkeypatch):
    monkeypatch.setattr(machine, "capabilities", lambda: CPU_ONLY)
    for policy in ("float32", "mixed_bfloat16"):  # kmp leaves it on
        kmp.set_policy(policy)
        report = kmp.precision_report(kmp.compile(mlp(), optimizer="sgd", loss="mse"))
        assert report.remapper == "" and "remapping" not in str(report), policy
    # With a GPU, kmp never switches it: float16 says nothing either.
    monkeypatch.setattr(machine, "capabilities", lambda: WITH_GPU)
    kmp.set_policy("mixed_float16")
    report = kmp.precision_report(kmp.compile(mlp(), optimizer="sgd", loss="mse"))
    assert report.remapper == "" and "remapping" not in str(report)


def _head(output, length=8):
    """Token embeddings (16 wide, `length` positions) to 50 classes; `output`
    ends it."""
    inputs = keras.Input((length,), dtype="int32")
    hidden = keras.layers.Embedding(100, 16)(inputs)
    return keras.Model(inputs, output(hidden))


def _guide_softmax(hidden, classes=50):
    # Keras's mixed-precision guide: the softmax a float32 layer of its own.
    logits = keras.layers.Dense(classes, name="logits")(hidden)
    return keras.layers.Activation("softmax", dtype="float32", name="probs")(logits)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_the_report_says_what_a_float32_softmax_layer_on_16_bit_logits_keeps(policy):
    kmp.set_policy(policy)
    report = kmp.precision_report(kmp.prepare(_head(_guide_softmax)))
    assert (
        "the output 'probs' computes a float32 softmax of 'logits''s 16-bit logits"
        in report.memory
    )
    assert "(50 16-bit values per output position, 100 bytes)" in report.memory
    assert "Folding it into 'logits' (activation='softmax')" in report.memory
    assert "from_logits=True" in report.memory and "16 inputs" in report.memory
    assert report.memory in str(report).replace("\n", " ")
    # Keras's own Softmax layer at the output, which kmp computes in float32,
    # on a sequence of unknown length (the size is per position).
    model = _head(
        lambda h: keras.layers.Softmax(name="p")(keras.layers.Dense(50, name="d")(h)),
        length=None,
    )
    memory = kmp.precision_report(kmp.prepare(model)).memory
    assert "the output 'p' computes a float32 softmax of 'd''s 16-bit" in memory


def _added(hidden):
    # The softmax's input made by a layer without an activation to fold into.
    a, b = keras.layers.Dense(50)(hidden), keras.layers.Dense(50)(hidden)
    return keras.layers.Activation("softmax", dtype="float32")(
        keras.layers.Add()([a, b])
    )


@pytest.mark.parametrize(
    "output",
    [
        # Folded into the last layer: kmp computes the whole layer in float32.
        lambda h: keras.layers.Dense(50, activation="softmax")(h),
        # Logits out (the loss from logits).
        lambda h: keras.layers.Dense(50)(h),
        # A softmax inside the model, not its output.
        lambda h: keras.layers.Dense(50)(keras.layers.Activation("softmax")(h)),
        # A classifier head with fewer classes than inputs: a float32 Dense
        # would keep a float32 copy of its 16 inputs, more than it saves.
        lambda h: _guide_softmax(h, classes=10),
        _added,
        # Logits through an activation of their own: nothing to fold into.
        lambda h: keras.layers.Activation("softmax", dtype="float32")(
            keras.layers.Dense(50, activation="relu")(h)
        ),
    ],
)
def test_the_report_says_nothing_where_folding_the_softmax_saves_nothing(output):
    kmp.set_policy("mixed_bfloat16")
    assert "logits" not in kmp.precision_report(kmp.prepare(_head(output))).memory


def test_the_output_note_reads_the_policy_the_logits_compute_in_now():
    kmp.set_policy("float32")
    assert kmp.precision_report(kmp.prepare(_head(_guide_softmax))).memory == ""
    # Built under bfloat16, its logits then computed in float32 by a rule.
    kmp.set_policy("mixed_bfloat16")
    model = _head(_guide_softmax)
    kmp.set_layer_policy("name:logits", "float32")
    report = kmp.precision_report(kmp.prepare(model))
    assert model.get_layer("logits").compute_dtype == "float32"
    assert "logits" not in report.memory


def test_both_memory_notes_are_said_together():
    kmp.set_policy("mixed_bfloat16")
    model = _head(lambda h: _guide_softmax(keras.layers.LayerNormalization()(h)))
    memory = kmp.precision_report(kmp.prepare(model)).memory
    assert "normalization layer" in memory and "'probs' computes" in memory


def _conv_net():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)  # reads 8*8*3
    x = keras.layers.Conv2D(2, 3, name="conv_2")(x)  # reads 8*8*4
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))


def _segmentation_net():
    """Its output is a convolution's: a convolution like the others."""
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="body")(inputs)
    shared = keras.layers.Conv2D(4, 3, padding="same", name="shared")
    x = shared(shared(x))  # called twice: reads 8*8*4 twice
    return keras.Model(inputs, keras.layers.Conv2D(2, 1, name="head")(x))


def test_the_report_says_what_float32_convolutions_under_float16_cost():
    if not planning._float16_convolutions_are_slow():
        pytest.skip("kmp's float16 speed rule applies on machines without GPUs")
    kmp.set_policy("mixed_float16")
    memory = kmp.precision_report(kmp.prepare(_conv_net()), trace=False).memory
    assert "2 convolution layers ('conv', 'conv_2') compute in float32" in memory
    assert f": {8 * 8 * 3 + 8 * 8 * 4:,} values per sample" in memory
    assert "kmp.rules.set_cpu_convolutions('memory')" in memory
    model = kmp.prepare(_segmentation_net())
    memory = kmp.precision_report(model, trace=False).memory
    assert "3 convolution layers ('body', 'shared', 'head') compute" in memory
    assert f": {8 * 8 * 3 + 3 * 8 * 8 * 4:,} values per sample" in memory


def test_the_cpu_convolutions_switch_trades_the_speed_back_for_memory():
    if not planning._float16_convolutions_are_slow():
        pytest.skip("kmp's float16 speed rule applies on machines without GPUs")
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(_segmentation_net())
    assert model.get_layer("body").compute_dtype == "float32"
    kmp.rules.set_cpu_convolutions("memory")
    model = kmp.prepare(model)  # a prepared model, prepared again
    assert model.get_layer("body").compute_dtype == "float16"
    assert model.get_layer("shared").compute_dtype == "float16"
    assert model.get_layer("head").compute_dtype == "float16"  # output: a cast
    assert kmp.precision_report(model, trace=False).memory == ""
    with pytest.raises(ValueError, match="'speed'"):
        kmp.rules.set_cpu_convolutions("fast")


def test_the_report_is_silent_on_convolutions_under_bfloat16():
    kmp.set_policy("mixed_bfloat16")
    assert kmp.precision_report(kmp.prepare(_conv_net()), trace=False).memory == ""
