import keras
import numpy as np
import pytest

import kmp
from kmp import debug


def blown_model(blow, policy="mixed_float16", compile_model=True):
    """hidden -> blown -> out, with the `blown` kernel multiplied by `blow`."""
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(16, activation="relu", name="blown"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    kernel = model.get_layer("blown").kernel
    kernel.assign(kernel * blow)
    if compile_model:
        kmp.compile(
            model,
            optimizer=kmp.LossScaleOptimizer(
                keras.optimizers.Adam(1e-3), initial_scale=1024
            ),
            loss="mse",
        )
    return model


def data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, x[:, :1]


def test_find_nonfinite_names_the_layer_whose_output_overflows():
    model = blown_model(1e6)
    x, _ = data()
    report = kmp.debug.find_nonfinite(model, x)
    assert report.found and report.phase == "forward"
    assert (report.layer, report.class_name, report.compute_dtype) == (
        "blown",
        "Dense",
        "float16",
    )
    assert np.isfinite(report.input_max_abs) and not np.isfinite(report.output_max_abs)
    assert "kmp.set_layer_policy(Dense, 'float32')" in report.fix
    assert "'blown'" in str(report)
    assert [c.path for c in report.checks] == ["hidden", "blown", "out"]


def test_find_nonfinite_reports_nothing_for_a_healthy_model():
    model = blown_model(1.0)
    x, y = data()
    report = kmp.debug.find_nonfinite(model, x, y)
    assert not report.found
    assert "No inf/NaN" in str(report)


def test_following_the_suggested_fixes_ends_the_overflow():
    model = blown_model(1e6)
    x, _ = data()
    named = []
    for _ in range(3):
        report = kmp.debug.find_nonfinite(model, x)
        if not report.found:
            break
        named.append(report.layer)
        kmp.set_layer_policy(f"name:{report.layer}", "float32")
        kmp.prepare(model)
    # 'blown' overflows; in float32 its output (above 65504) then overflows
    # the float16 layer reading it, which is named next.
    assert named == ["blown", "out"]
    assert not kmp.debug.find_nonfinite(model, x).found


def test_find_nonfinite_with_targets_searches_the_backward_pass():
    model = blown_model(1e4)  # forward finite, gradients overflow at scale 1024
    x, y = data()
    assert not kmp.debug.find_nonfinite(model, x).found
    report = kmp.debug.find_nonfinite(model, x, y)
    assert report.found and report.phase == "backward"
    assert report.layer == "out"  # the first layer in backward order
    assert "loss scale 1024" in report.note
    assert "'blown'" in report.note  # the largest activation points upstream


def test_find_nonfinite_recurses_into_nested_models():
    kmp.set_policy("mixed_float16")
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="ok"),
            keras.layers.Dense(4, name="bad"),
        ],
        name="block",
    )
    bad = inner.get_layer("bad")
    bad.set_weights([np.full((4, 4), 1e4, "float32"), np.zeros(4, "float32")])
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(inner(inputs)))
    report = kmp.debug.find_nonfinite(model, np.full((2, 4), 100.0, "float32"))
    assert report.layer == "block/bad"


def test_find_nonfinite_on_a_subclassed_model_says_what_it_could_check():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x) * 1e6

    kmp.set_policy("mixed_float16")
    report = kmp.debug.find_nonfinite(Net(), np.ones((1, 3), "float32"))
    assert report.found
    assert "subclassed" in report.note


def test_find_nonfinite_backward_needs_a_compiled_model():
    model = blown_model(1.0, compile_model=False)
    x, y = data()
    with pytest.raises(ValueError, match="not compiled"):
        kmp.debug.find_nonfinite(model, x, y)


def test_last_overflow_names_layers_with_non_finite_gradients():
    model = blown_model(1e4, compile_model=False)
    model.compile(
        optimizer=kmp.LossScaleOptimizer("adam", mode="static", initial_scale=1.0),
        loss="mse",
    )
    x, y = data()
    model.train_on_batch(x, y)
    sources = kmp.debug.last_overflow(model)
    assert sources and not sources.forward
    # The blown kernel makes its neighbours' gradients overflow: the layer
    # reading its huge output ('out') and the one behind it ('hidden').
    assert set(sources.layers) == {"hidden", "out"}
    assert {v.split("/")[-2] for v in sources.variables} == {"hidden", "out"}


def test_last_overflow_marks_a_forward_overflow():
    model = blown_model(1e6)
    x, y = data()
    model.train_on_batch(x, y)
    sources = kmp.debug.last_overflow(model)
    assert sources.forward
    assert "blown" in sources.layers
    assert "find_nonfinite" in str(sources)


def test_last_overflow_needs_a_kmp_optimizer():
    model = blown_model(1.0, compile_model=False)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"kmp\.LossScaleOptimizer"):
        kmp.debug.last_overflow(model)


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
        ]
    )
    assert len(kmp.debug.precision_audit(model)) == 0  # fine in float32
    report = kmp.debug.precision_audit(model, policy="mixed_float16")
    by_layer = {(r.layer, r.kind) for r in report}
    assert ("odd", "size not a multiple of 8") in by_layer
    assert ("even", "size not a multiple of 8") in by_layer  # its input is 12
    assert ("halve", "dtype error") in by_layer
    assert ("norm", "16-bit softmax/normalization") in by_layer
    assert "keras.ops.cast" in str(report)
    assert model.get_layer("halve").compute_dtype == "float32"  # restored


def test_precision_audit_is_clean_for_a_prepared_float32_model():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)])
    assert len(kmp.debug.precision_audit(model)) == 0  # float32: no 16-bit risks


def test_debug_functions_reject_non_models():
    for fn in (debug.precision_audit, lambda m: debug.find_nonfinite(m, 1)):
        with pytest.raises(TypeError, match="expects a Keras model"):
            fn("model")


def test_find_nonfinite_reports_a_non_finite_input_batch():
    model = blown_model(1.0)
    x, _ = data()
    x[3, 2] = np.nan
    report = kmp.debug.find_nonfinite(model, x)
    assert report.found and report.layer == "<input>"
    assert "clean or filter the data" in report.fix


def test_find_nonfinite_says_so_when_a_shared_layer_overflows_later():
    kmp.set_policy("mixed_float16")
    shared = keras.layers.Dense(4, name="shared")
    inputs = keras.Input((4,))
    outputs = shared(shared(inputs))  # the second call overflows
    model = keras.Model(inputs, outputs)
    shared.set_weights([np.full((4, 4), 300.0, "float32"), np.zeros(4, "float32")])
    report = kmp.debug.find_nonfinite(model, np.ones((1, 4), "float32"))
    assert report.found
    assert "more than once" in report.note
