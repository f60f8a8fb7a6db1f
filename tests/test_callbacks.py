import csv
import logging
import struct

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_debug import blown_model
from test_debug import data

import kmp
from kmp.callbacks import LossScaleMonitor
from kmp.callbacks import NonFiniteGuard
from kmp.callbacks import TrainingCollapsedError


def test_an_overflowing_layer_is_seen_attributed_found_and_stopped():
    """The whole story on one model whose `blown` layer overflows float16."""
    model = blown_model(1e6)
    x, y = data(256)
    guard = NonFiniteGuard(max_consecutive_skips=3, probe=x[:32])
    with pytest.raises(TrainingCollapsedError) as info:
        model.fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[guard])
    error = info.value
    # NonFiniteGuard: stopped, with the cause and the layer.
    assert error.cause == "forward"
    assert error.layers == ("blown",)
    assert "non-finite forward values" in str(error)
    assert "'blown'" in str(error)
    # Every step was skipped; the guard acted when the scale hit its floor
    # (1024 -> 1: 10 backoffs), in epoch 2. History has epoch 1's telemetry.
    opt = model.optimizer
    assert float(opt.loss_scale) == 1.0
    assert int(opt.skipped_steps_total) == 10
    assert model.history.history["skipped_steps"] == [8.0]
    assert model.history.history["loss_scale"] == [4.0]
    # Attribution: a forward overflow, which involves `blown`.
    sources = kmp.debug.last_overflow(model)
    assert sources.forward and "blown" in sources.layers
    # find_nonfinite names the layer.
    assert kmp.debug.find_nonfinite(model, x[:32]).layer == "blown"
    # No weight became NaN.
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)


def test_history_holds_the_scale_and_skips_per_epoch():
    model = blown_model(1e6)
    x, y = data(128)
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    h = history.history
    assert h["skipped_steps"] == [4.0, 4.0]  # every step of each epoch
    assert h["skipped_steps_total"] == [4.0, 8.0]
    assert h["loss_scale"] == [1024.0 / 2**4, 1024.0 / 2**8]


def test_gradient_overflow_at_every_scale_is_diagnosed_with_its_layers():
    model = blown_model(1e4)
    x, y = data(256)
    guard = NonFiniteGuard(max_consecutive_skips=3, probe=x[:32], probe_targets=y[:32])
    with pytest.raises(TrainingCollapsedError) as info:
        model.fit(x, y, batch_size=32, epochs=10, verbose=0, callbacks=[guard])
    text = str(info.value)
    assert info.value.cause == "gradient"
    # The layers whose gradients overflow are the blown layer's neighbours
    # (the output layer computes in float16, its output cast)...
    assert set(info.value.layers) == {"hidden", "out"}
    assert "gradient overflow at every scale" in text
    # ... and the backward search on the probe points at the blown layer.
    assert "Largest amplification: 'blown'" in text
    assert "kmp.set_layer_policy('name:hidden', 'float32')" in text


def test_stop_ends_training_and_warn_goes_on(caplog):
    x, y = data(256)
    # The collapse comes at step 10, in epoch 2 of 3.
    for mode, expect_epochs in (("stop", 2), ("warn", 3)):
        model = blown_model(1e6)
        guard = NonFiniteGuard(max_consecutive_skips=2, on_collapse=mode)
        with caplog.at_level(logging.WARNING, logger="kmp"):
            history = model.fit(
                x, y, batch_size=32, epochs=3, verbose=0, callbacks=[guard]
            )
        assert len(history.history["loss"]) == expect_epochs, mode
        assert guard.diagnosis is not None and guard.diagnosis.cause == "forward"
    assert sum("Training collapsed" in r.message for r in caplog.records) == 2


def test_guard_rejects_bad_arguments():
    with pytest.raises(ValueError, match="on_collapse"):
        NonFiniteGuard(on_collapse="explode")
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        NonFiniteGuard(max_consecutive_skips=0)


def test_guard_without_kmp_optimizer_acts_on_nan_weights_only():
    kmp.set_policy("float32")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((64, 2), "float32")
    x[8] = np.nan  # batch 1 poisons plain SGD's weights
    guard = NonFiniteGuard(max_consecutive_skips=2)
    with pytest.raises(TrainingCollapsedError, match="weights have become") as info:
        model.fit(x, np.ones((64, 1)), batch_size=8, verbose=0, callbacks=[guard])
    assert info.value.cause == "weights"


def test_guard_does_not_fire_when_keras_own_wrapper_skips_one_bad_batch():
    # Keras's loss mean stays inf for the rest of the epoch after one bad
    # batch; the weights stay finite, so there is nothing to stop.
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")  # Keras wraps it itself
    x = np.ones((64, 2), "float32")
    x[8] = np.inf
    guard = NonFiniteGuard(max_consecutive_skips=2)
    model.fit(x, np.ones((64, 1)), batch_size=8, verbose=0, callbacks=[guard])
    assert guard.diagnosis is None


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_monitor_writes_tensorboard_csv_and_png(tmp_path):
    model = blown_model(30.0)  # overflows early at 1024, then settles
    x, y = data(256)
    monitor = LossScaleMonitor(
        log_dir=tmp_path / "tb",
        csv_path=tmp_path / "scale.csv",
        plot_path=tmp_path / "scale.png",
    )
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[monitor])
    assert len(monitor.records) == 16
    skipped = [r for r in monitor.records if r.skipped]
    assert skipped, "precondition: some steps were skipped"
    assert all(r.overflow_layers for r in skipped)

    # TensorBoard: read the event file back with TensorBoard's own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }
    # ... and with TensorFlow's raw event iterator, for the text summaries.
    texts = [
        value.tag
        for event_file in (tmp_path / "tb").glob("events.out.tfevents.*")
        for event in tf.compat.v1.train.summary_iterator(str(event_file))
        for value in event.summary.value
    ]
    assert "kmp/overflow_layers" in texts
    assert [s for s, _ in scalars["kmp/loss_scale"]] == list(range(1, 17))
    assert [v for _, v in scalars["kmp/loss_scale"]] == [
        r.loss_scale for r in monitor.records
    ]
    assert sum(v for _, v in scalars["kmp/skipped_steps"]) == len(skipped)

    # CSV
    with open(tmp_path / "scale.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 16
    assert [float(r["loss_scale"]) for r in rows] == [
        r.loss_scale for r in monitor.records
    ]
    assert {r["overflow_layers"] for r in rows if r["skipped"] != "0"} != {""}

    # PNG
    assert png_size(tmp_path / "scale.png") == (800, 500)


def test_monitor_every_n_steps_counts_the_skips_in_between():
    model = blown_model(1e6)
    x, y = data(256)
    monitor = LossScaleMonitor(every_n_steps=4)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    assert [r.step for r in monitor.records] == [4, 8]
    assert [r.skipped for r in monitor.records] == [4, 4]


def test_event_files_sort_in_the_order_made(tmp_path, monkeypatch):
    """TensorBoard reads a folder's event files in the order of their names."""
    import itertools

    from kmp.diagnostics import records

    monkeypatch.setattr(records, "_EVENT_FILES", itertools.count(8))
    made = []
    for _ in range(4):  # numbers 8 to 11: "10" sorts before "8" as text
        before = set(tmp_path.iterdir())
        records.EventFile(str(tmp_path)).close()
        (new,) = set(tmp_path.iterdir()) - before
        made.append(new.name)
    assert sorted(made) == made


def test_a_resumed_runs_monitor_counts_on_from_its_initial_step():
    model = blown_model(1e6)
    x, y = data(256)
    monitor = LossScaleMonitor(every_n_steps=4, initial_step=6)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    # Steps 7 to 14: a record where the count passes 8 and 12, and the tail.
    assert [r.step for r in monitor.records] == [8, 12, 14]
    assert [r.skipped for r in monitor.records] == [2, 4, 2]
    with pytest.raises(ValueError, match=r"initial_step must be .* Received: -1\."):
        LossScaleMonitor(initial_step=-1)


def test_monitor_without_kmp_optimizer_logs_loss_and_says_so_once(caplog):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    monitor = LossScaleMonitor()
    with caplog.at_level(logging.WARNING, logger="kmp"):
        for _ in range(2):
            model.fit(
                np.ones((8, 2)),
                np.ones((8, 1)),
                batch_size=4,
                verbose=0,
                callbacks=[monitor],
            )
    said = [r.message for r in caplog.records if "model.compile" in r.message]
    assert len(said) == 1 and "SGD alone (non-finite steps are applied)" in said[0]
    assert "kmp.compile(model, ...)" in said[0]
    assert len(monitor.records) == 4
    assert all(r.loss_scale is None and np.isfinite(r.loss) for r in monitor.records)


def test_monitor_without_loss_scaling_logs_the_loss_and_the_skips(caplog):
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kmp.compile(model, optimizer="sgd", loss="mse")
    assert model.optimizer.mode == "none"
    monitor = LossScaleMonitor()
    x = np.ones((8, 2), "float32")
    x[5] = np.inf  # batch 2 is skipped, not applied
    with caplog.at_level(logging.INFO, logger="kmp"):
        model.fit(x, np.ones((8, 1)), batch_size=4, verbose=0, shuffle=False,
                  callbacks=[monitor])  # fmt: skip
    assert any("mode 'none'" in r.message for r in caplog.records)
    assert [r.loss_scale for r in monitor.records] == [None, None]
    assert [r.skipped for r in monitor.records] == [0, 1]
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)


def test_monitor_reads_the_scale_of_keras_own_wrapper():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")  # Keras wraps it in its own
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    monitor = LossScaleMonitor()
    model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, verbose=0,
              callbacks=[monitor])  # fmt: skip
    scales = [r.loss_scale for r in monitor.records]
    assert len(scales) == 2 and None not in scales
    assert scales[-1] == float(model.optimizer.dynamic_scale)
    assert [r.skipped_steps_total for r in monitor.records] == [None, None]


def test_monitor_rejects_unwritable_paths_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="cannot be created"):
        LossScaleMonitor(log_dir=blocker / "tb")
    with pytest.raises(ValueError, match="cannot be created"):
        LossScaleMonitor(csv_path=blocker / "sub" / "x.csv")
    with pytest.raises(ValueError, match="every_n_steps"):
        LossScaleMonitor(every_n_steps=0)
    assert blocker.read_text() == "not a folder"  # nothing touched


def test_monitor_counts_every_skip_with_a_partial_last_interval():
    model = blown_model(1e6)
    x, y = data(256)  # 8 steps per epoch
    monitor = LossScaleMonitor(every_n_steps=3)
    # Every step is skipped: a guard that lets the run go on to its end.
    guard = NonFiniteGuard(max_consecutive_skips=100, on_collapse="warn")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[monitor, guard])
    assert [r.step for r in monitor.records] == [3, 6, 8, 9, 12, 15, 16]
    assert sum(r.skipped for r in monitor.records) == 16
    assert all(r.forward for r in monitor.records)


def test_monitor_steps_follow_steps_per_execution():
    model = blown_model(1.0, compile_model=False)
    kmp.compile(
        model,
        optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=8.0),
        loss="mse",
        steps_per_execution=4,
    )
    x, y = data(256)
    monitor = LossScaleMonitor()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    assert [r.step for r in monitor.records] == [4, 8]


def test_monitor_keeps_its_records_when_the_guard_stops_the_run(tmp_path):
    model = blown_model(1e6)
    x, y = data(256)
    monitor = LossScaleMonitor(csv_path=tmp_path / "log.csv")
    guard = NonFiniteGuard(max_consecutive_skips=3)
    with pytest.raises(TrainingCollapsedError):
        model.fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[monitor, guard])
    assert len(monitor.records) == 10  # every step up to the collapse
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10
    assert rows[-1]["overflow_layers"].startswith("forward overflow")
    monitor.plot(tmp_path / "after.png")
    assert png_size(tmp_path / "after.png") == (800, 500)


def test_guard_without_loss_scaling_acts_on_skipped_steps_and_no_weight_is_poisoned():
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kmp.compile(model, optimizer="sgd", loss="mse")
    assert model.optimizer.mode == "none"
    x = np.full((64, 2), np.nan, "float32")  # every batch non-finite
    guard = NonFiniteGuard(max_consecutive_skips=3)
    with pytest.raises(TrainingCollapsedError, match="no loss scaling") as info:
        model.fit(x, np.ones((64, 1)), batch_size=8, verbose=0, callbacks=[guard])
    assert info.value.cause == "forward"  # the loss itself is NaN
    assert int(model.optimizer.skipped_steps_total) == 3
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)


def counting_optimizer(*args, **kwargs):
    """A kmp.LossScaleOptimizer that notes every eager read of its
    `consecutive_skips` (each a device-to-host copy), and a callback that
    counts the batch ends; `reads` holds the batch ends seen at each read."""
    reads, ends = [], [0]

    class CountingLossScaleOptimizer(kmp.LossScaleOptimizer):
        @property
        def consecutive_skips(self):
            if tf.executing_eagerly():
                reads.append(ends[0])
            return super().consecutive_skips

    def count(batch, logs):
        ends[0] += 1

    counter = keras.callbacks.LambdaCallback(on_train_batch_end=count)
    return CountingLossScaleOptimizer(*args, **kwargs), counter, reads, ends


def test_guard_reads_the_skips_from_the_logs_not_the_device_per_batch():
    model = blown_model(1e6, compile_model=False)
    opt, counter, reads, ends = counting_optimizer(
        keras.optimizers.Adam(1e-3), initial_scale=1024
    )
    kmp.compile(model, optimizer=opt, loss="mse")
    x, y = data(256)
    guard = NonFiniteGuard(max_consecutive_skips=3)
    with pytest.raises(TrainingCollapsedError) as info:
        model.fit(x, y, batch_size=32, epochs=5, verbose=0,
                  callbacks=[counter, guard])  # fmt: skip
    # The same step as with a read per batch: the scale reached its floor
    # at step 10 (1024 -> 1), in epoch 2.
    assert ends[0] == 10 and int(opt.skipped_steps_total) == 10
    assert float(opt.loss_scale) == 1.0 and info.value.cause == "forward"
    # One read, at the start of fit, none per batch: the logs carry the rest.
    assert reads == [0]


def test_guard_follows_the_logs_with_steps_per_execution_and_mixed_steps():
    # No loss scaling (bfloat16): the guard acts on 3 skipped steps in a row.
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt, counter, reads, ends = counting_optimizer("sgd", mode="none")
    kmp.compile(model, optimizer=opt, loss="mse", steps_per_execution=4)
    # Logs come at steps 4, 8 and 12; "N" is a non-finite batch.
    pattern = ".NN." + "N.NN" + "NNNN" + "...."
    x = np.ones((8 * len(pattern), 2), "float32")
    for i, step in enumerate(pattern):
        if step == "N":
            x[8 * i : 8 * i + 8] = np.nan
    guard = NonFiniteGuard(max_consecutive_skips=3)
    with pytest.raises(TrainingCollapsedError, match="no loss scaling"):
        model.fit(x, np.ones((len(x), 1)), batch_size=8, shuffle=False, verbose=0,
                  callbacks=[counter, guard])  # fmt: skip
    # Step 4: 0 in a row; step 8: 2 (the logs allow 0 to 3: one read);
    # step 12: 6, collapsed, known from the logs alone.
    assert ends[0] == 3 and int(opt.skipped_steps_total) == 9
    assert reads == [0, 2]


def test_guard_reads_the_device_per_batch_when_the_logs_lack_the_skips():
    class OwnLogs(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                scaled = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}  # no telemetry in these logs

    kmp.set_policy("mixed_float16")
    model = OwnLogs(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(16, activation="relu", name="blown"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    kernel = model.get_layer("blown").kernel
    kernel.assign(kernel * 1e6)
    opt, counter, reads, ends = counting_optimizer(
        keras.optimizers.Adam(1e-3), initial_scale=1024
    )
    # Compiled by Keras (kmp.compile would add the telemetry to these logs).
    model.compile(optimizer=opt, loss="mse")
    x, y = data(256)
    guard = NonFiniteGuard(max_consecutive_skips=3)
    with pytest.raises(TrainingCollapsedError) as info:
        model.fit(x, y, batch_size=32, epochs=5, verbose=0,
                  callbacks=[counter, guard])  # fmt: skip
    assert "skipped_steps_total" not in model.history.history
    assert ends[0] == 10 and int(opt.skipped_steps_total) == 10
    assert info.value.cause == "forward"
    # One read at the start of fit, then one per batch: nothing else to go on.
    assert reads == list(range(11))


def test_guard_counts_the_skips_in_a_row_across_fits():
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt, counter, reads, ends = counting_optimizer("sgd", mode="none")
    kmp.compile(model, optimizer=opt, loss="mse")
    guard = NonFiniteGuard(max_consecutive_skips=3)
    x = np.ones((32, 2), "float32")
    x[16:] = np.nan  # the last two of four steps are skipped
    fit = dict(batch_size=8, shuffle=False, verbose=0, callbacks=[counter, guard])
    model.fit(x, np.ones((32, 1)), **fit)
    assert guard.diagnosis is None and int(opt.skipped_steps_total) == 2
    with pytest.raises(TrainingCollapsedError):  # the third in a row
        model.fit(np.flip(x, 0), np.ones((32, 1)), **fit)
    assert ends[0] == 5 and reads == [0, 4]  # at the start of each fit


def test_monitor_records_the_applied_steps_loss_after_a_skipped_inf_step():
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    kmp.compile(model, optimizer=keras.optimizers.SGD(0.0), loss="mse")
    # Small targets: the float16 bias gradient stays finite at the first scale.
    x, y = np.full((32, 4), 0.01, "float32"), np.full((32, 1), 0.1, "float32")
    x[8:16] = 1e30  # the second batch overflows float16: its loss is inf
    monitor = LossScaleMonitor()
    history = model.fit(
        x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor]
    )
    assert [r.skipped for r in monitor.records] == [0, 1, 0, 0]
    assert not np.isfinite(history.history["loss"][0])  # Keras's own mean
    # The record follows what trained: finite after the skipped step.
    assert np.isfinite([r.loss for r in monitor.records]).all()
