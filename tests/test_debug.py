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
    # the float16 output layer, named next: fixed in two steps.
    assert named == ["blown", "out"]
    assert not kmp.debug.find_nonfinite(model, x).found


def test_find_nonfinite_with_targets_searches_the_backward_pass():
    model = blown_model(1e4)  # forward finite, gradients overflow at scale 1024
    x, y = data()
    assert not kmp.debug.find_nonfinite(model, x).found
    report = kmp.debug.find_nonfinite(model, x, y)
    assert report.found and report.phase == "backward"
    # The first layer in backward order: `out`, in float16 (its output cast).
    assert report.layer == "out"
    assert report.compute_dtype == "float16"
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


@pytest.mark.parametrize(
    "policy, rounded",
    [("mixed_bfloat16", "19999 becomes 19968"), ("mixed_float16", "out of range")],
)
def test_precision_audit_names_float_token_ids_rounded_on_their_way(policy, rounded):
    class Tokens(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embed = keras.layers.Embedding(20000, 8)

        def call(self, x):
            return self.embed(x)

    ids = keras.Input((5,))  # float32: the keras.Input default
    model = keras.Model(ids, keras.layers.Dense(2)(Tokens(name="tokens")(ids)))
    audit = kmp.debug.precision_audit(model, policy=policy)
    risk = next(r for r in audit if r.kind == "float token ids")
    assert risk.layer == "tokens" and rounded in risk.detail
    assert "dtype='int32'" in risk.fix
    int_ids = keras.Input((5,), dtype="int32")
    clean = keras.Model(int_ids, keras.layers.Dense(2)(Tokens()(int_ids)))
    assert "float token ids" not in kmp.debug.precision_audit(clean, policy).kinds()
