"""kmp.debug.gradient_underflow: what float16 loses of each layer's
gradients at a loss scale, measured in one float32 pass, agreeing with what
a float16 backward pass really loses; in the report and the monitor."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.backend import float32_pass
from kmp.backend import underflow


def spanning_model():
    """Dense 'a' (16 -> 32, float16) and a float32 head, on inputs whose
    columns span seven orders of magnitude: so do the rows of 'a''s kernel
    gradient, part of which float16 flushes to zero at a scale of 1."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, name="a")(inputs)
    outputs = keras.layers.Dense(4, name="head", dtype="float32")(h)
    model = keras.Model(inputs, outputs, name="spanning")
    model.compile(loss="mse")
    return model


def spanning_data(decades: int = 7):
    rng = np.random.default_rng(0)
    magnitudes = np.logspace(0, -decades, 16).astype("float32")
    x = rng.normal(size=(64, 16)).astype("float32") * magnitudes
    y = rng.normal(size=(64, 4)).astype("float32") * 1e-2
    return x, y


def lost_in_float16(model, x, y, scale):
    """How many of 'a''s nonzero float32 gradient values are zero in the
    float16 backward pass at `scale`, and how many are nonzero."""

    def gradients():
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred) * scale
        return [g.numpy() for g in tape.gradient(loss, model.get_layer("a").weights)]

    sixteen = gradients()
    with float32_pass.every_layer_in_float32(model):
        reference = gradients()
    nonzero = sum(int(np.count_nonzero(g)) for g in reference)
    lost = sum(
        int(np.count_nonzero((r != 0) & (g == 0)))
        for r, g in zip(reference, sixteen, strict=True)
    )
    return lost, nonzero


def test_the_measure_agrees_with_what_a_float16_backward_pass_loses():
    kmp.set_policy("mixed_float16")
    model = spanning_model()
    x, y = spanning_data()
    for scale, lossy in ((1.0, True), (256.0, True), (65536.0, False)):
        row = underflow.gradient_underflow(model, x, y, scale).layers[0]
        lost, nonzero = lost_in_float16(model, x, y, scale)
        assert row.path == "a" and row.dtype == "float16"
        assert row.values == nonzero
        # The float32 measure foresees the float16 pass's zeros to within a
        # few values in a hundred (the float16 pass also rounds its inputs).
        assert abs(row.flushed - lost) <= 0.02 * nonzero, (scale, row, lost)
        assert (row.flushed_fraction > 0.005) == lossy
    # A quarter of the values at scale 1; a larger scale loses fewer.
    at_one = underflow.gradient_underflow(model, x, y, 1.0).layers[0]
    assert at_one.flushed_fraction > 0.2
    assert at_one.headroom > 1e4
    # The head computes in float32: not measured.
    assert [r.path for r in underflow.gradient_underflow(model, x, y, 1.0).layers] == [
        "a"
    ]


class Scaled(keras.layers.Layer):
    """Raw TensorFlow on its own weight, as user layers are written."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return tf.nn.relu(x) * tf.cast(self.gain, x.dtype)


def test_the_measure_changes_nothing_of_the_model():
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10,), dtype="int32")
    h = keras.layers.Embedding(50, 8, name="embed")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, name="dense")(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dropout(0.5)(h)
    h = Scaled(name="scaled")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(h))
    model = kmp.compile(model, optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(32, 10))
    y = rng.normal(size=(32, 3)).astype("float32")
    model.fit(x, y, epochs=1, verbose=0)
    before = [v.numpy().copy() for v in model.variables]
    metrics = [v.numpy().copy() for v in model.metrics_variables]
    dtypes = [layer.compute_dtype for layer in model.layers]
    measured = kmp.debug.gradient_underflow(model, x, y)
    assert not measured.error
    # The embedding's gradient (rows gathered) is measured, as is the user
    # layer's raw-TensorFlow weight.
    assert {r.path for r in measured.layers} >= {"embed", "dense", "scaled"}
    assert all(r.values > 0 for r in measured.layers)
    assert measured.scale == float(model.optimizer.loss_scale.numpy())
    for was, v in zip(before, model.variables, strict=True):
        np.testing.assert_array_equal(was, v.numpy(), err_msg=v.path)
    for was, v in zip(metrics, model.metrics_variables, strict=True):
        np.testing.assert_array_equal(was, v.numpy())
    assert [layer.compute_dtype for layer in model.layers] == dtypes
    # Training goes on as before.
    history = model.fit(x, y, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_a_measured_model_is_freed_and_a_new_loss_is_measured_anew():
    import gc
    import weakref

    kmp.set_policy("mixed_float16")
    x, y = spanning_data()
    model = spanning_model()
    mse = kmp.debug.gradient_underflow(model, x, y, scale=1.0)
    # Compiled again with another loss: measured with that loss, not with
    # the measure traced for the first.
    model.compile(loss=lambda t, p: 1e4 * keras.ops.mean(keras.ops.square(t - p)))
    larger = kmp.debug.gradient_underflow(model, x, y, scale=1.0)
    assert larger.layers[0].max_scaled == pytest.approx(
        1e4 * mse.layers[0].max_scaled, rel=1e-3
    )
    # The same loss with other weights: measured anew too.
    model.compile(loss="mse")
    assert kmp.debug.gradient_underflow(model, x, y, scale=1.0).layers[
        0
    ].max_scaled == pytest.approx(mse.layers[0].max_scaled, rel=1e-3)
    model.compile(loss="mse", loss_weights=100.0)
    weighted = kmp.debug.gradient_underflow(model, x, y, scale=1.0)
    assert weighted.layers[0].max_scaled == pytest.approx(
        100 * mse.layers[0].max_scaled, rel=1e-3
    )
    # The measure keeps no hold on the model.
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_the_advice_says_a_larger_scale_or_float32():
    kmp.set_policy("mixed_float16")
    model = spanning_model()
    x, y = spanning_data()
    room = underflow.gradient_underflow(model, x, y, 1.0)
    assert "a scale up to" in room.advice()
    assert room.worst().path == "a"
    assert "Gradient underflow at loss scale 1" in str(room)
    # Nothing notable: no advice.
    assert underflow.gradient_underflow(model, x, y, 65536.0).advice() == ""
    # Gradients that span more than float16's range: at a scale where the
    # largest is near float16's largest value the smallest still flush, and
    # only float32 keeps them all.
    x, y = spanning_data(decades=15)
    top = underflow.gradient_underflow(model, x, y, 1.0).layers[0].max_scaled
    tight = underflow.gradient_underflow(model, x, y, 40000.0 / top)
    assert tight.layers[0].headroom < 2 and tight.layers[0].flushed > 0
    assert "kmp.set_layer_policy('name:a', 'float32')" in tight.advice(0.0)


def test_bad_input_is_refused_with_the_fix():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    x, y = np.ones((4, 2)), np.ones((4, 1))
    with pytest.raises(ValueError, match="compiled"):
        kmp.debug.gradient_underflow(model, x, y)
    model.compile(loss="mse")
    with pytest.raises(ValueError, match="positive finite"):
        kmp.debug.gradient_underflow(model, x, y, scale=0.0)
    with pytest.raises(ValueError, match=r"\(x, y\)"):
        kmp.callbacks.LossScaleMonitor(underflow_sample=[x, y])
    with pytest.raises(ValueError, match=r"\(x, y\)"):
        kmp.precision_report(model, sample=x)
    # A batch the model cannot run on is said, not raised from deep inside.
    assert "Gradient underflow not measured" in str(
        kmp.debug.gradient_underflow(model, np.ones((4, 3)), y)
    )
    # In the monitor: said once, and training goes on unmeasured.
    monitor = kmp.callbacks.LossScaleMonitor(underflow_sample=(np.ones((4, 3)), y))
    with pytest.warns(UserWarning, match="training goes on without it"):
        history = model.fit(x, y, epochs=2, verbose=0, callbacks=[monitor])
    assert len(history.history["loss"]) == 2 and not monitor.underflows
    assert "gradient_underflow" not in history.history


def test_the_report_shows_the_underflow_per_layer():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(spanning_model(), optimizer="sgd", loss="mse")
    x, y = spanning_data()
    report = kmp.precision_report(model, sample=(x, y))
    assert report.row("a").gradient_underflow is not None
    assert report.row("head").gradient_underflow is None
    assert report.underflow.scale == float(model.optimizer.loss_scale.numpy())
    text = str(report)
    assert f"underflow at {report.underflow.scale:g}" in text
    assert "Underflow: the fraction" in text
    assert kmp.precision_report(model).row("a").gradient_underflow is None


def test_the_monitor_logs_underflow_each_epoch_and_the_heals(tmp_path):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, name="up")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    up = model.get_layer("up")
    up.kernel.assign(up.kernel * 1e4)  # its output overflows float16
    model = kmp.compile(model, optimizer="adam", loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 16)).astype("float32") * 4
    y = rng.normal(size=(128, 4)).astype("float32")
    path = tmp_path / "log.csv"
    monitor = kmp.callbacks.LossScaleMonitor(
        csv_path=path, log_dir=tmp_path / "tb", underflow_sample=(x[:32], y[:32])
    )
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, callbacks=[healer, monitor]
    )
    assert len(history.history["gradient_underflow"]) == 2
    assert [step for step, _ in monitor.underflows] == [8, 16]
    assert monitor.records[-1].gradient_underflow == pytest.approx(
        monitor.underflows[-1][1].flushed_fraction
    )
    healed = [r for r in monitor.records if r.healed]
    assert [h.layer for h in healer.heals] == ["up"]
    # Recorded once a step ran with it, with what 'up' then reached.
    assert len(healed) == 1 and healed[0].healed == (str(healer.heals[0]),)
    assert healer.heals[0].magnitude > 65504 and "reached" in healed[0].healed[0]
    assert healed[0].step > healer.heals[0].step
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(monitor.records) == 16  # one row per step
    assert [r["healed"] for r in rows if r["healed"]] == [str(healer.heals[0])]
    assert rows[7]["gradient_underflow"] != "" and rows[6]["gradient_underflow"] == ""


def test_an_epoch_of_unknown_length_is_measured_at_its_end(tmp_path):
    kmp.set_policy("mixed_float16")
    model = kmp.compile(spanning_model(), optimizer="sgd", loss="mse")
    x, y = spanning_data()

    def batches():
        for i in range(0, 64, 16):
            yield x[i : i + 16], y[i : i + 16]

    data = tf.data.Dataset.from_generator(
        batches,
        output_signature=(
            tf.TensorSpec((None, 16), tf.float32),
            tf.TensorSpec((None, 4), tf.float32),
        ),
    )
    path = tmp_path / "log.csv"
    monitor = kmp.callbacks.LossScaleMonitor(
        underflow_sample=(x, y), csv_path=path, log_dir=tmp_path / "tb"
    )
    history = model.fit(data, epochs=2, verbose=0, callbacks=[monitor])
    assert len(history.history["gradient_underflow"]) == 2
    # One record per step: the measure joined the last step's.
    assert [r.step for r in monitor.records] == list(range(1, 9))
    assert monitor.records[3].gradient_underflow is not None
    # So does its CSV row, written again in its place, and TensorBoard has
    # one value per step of each scalar.
    rows = list(csv.DictReader(path.open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert [r["gradient_underflow"] != "" for r in rows] == [False, False, False,
                                                             True] * 2  # fmt: skip
    steps = {}
    for event in tf.compat.v1.train.summary_iterator(
        str(next((tmp_path / "tb").glob("events*")))
    ):
        for value in event.summary.value:
            steps.setdefault(value.tag, []).append(event.step)
    assert steps["kmp/loss"] == list(range(1, 9))
    assert steps["kmp/gradient_underflow"] == [4, 8]


def test_bfloat16_layers_are_measured_against_bfloat16_s_range():
    kmp.set_policy("mixed_bfloat16")
    model = spanning_model()
    x, y = spanning_data()
    row = underflow.gradient_underflow(model, x, y, 1.0).layers[0]
    # bfloat16 has float32's exponent range: nothing flushes at scale 1.
    assert row.dtype == "bfloat16" and row.values > 0
    assert row.flushed == 0 and row.subnormal == 0
    assert row.headroom > 1e30


def test_a_csv_with_other_columns_is_refused_before_training(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(
        "step,epoch,loss,loss_scale,skipped,skipped_steps_total\n1,0,1,2,0,0\n"
    )
    with pytest.raises(ValueError, match=r"other columns.*new csv_path"):
        kmp.callbacks.LossScaleMonitor(csv_path=path)
    assert path.read_text().count("\n") == 2  # left as it was
