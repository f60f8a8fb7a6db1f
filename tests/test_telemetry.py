import keras
import numpy as np

import kmp


def test_attach_is_idempotent_and_reports_nothing_without_kmp_optimizer():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    kmp.telemetry.attach(model)
    kmp.telemetry.attach(model)
    telemetry = [
        m for m in model.metrics if isinstance(m, kmp.telemetry.LossScaleTelemetry)
    ]
    assert len(telemetry) == 1
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    assert set(history.history) == {"loss"}


def test_without_loss_scaling_history_shows_skipped_steps_and_no_scale():
    kmp.set_policy("mixed_bfloat16")
    for optimizer in (kmp.LossScaleOptimizer("sgd", mode="none"), "sgd"):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        kmp.compile(model, optimizer=optimizer, loss="mse")
        assert model.optimizer.mode == "none"  # kmp.compile wraps "sgd" too
        x = np.ones((4, 2), "float32")
        x[3] = np.nan
        history = model.fit(x, np.ones((4, 1)), batch_size=2, verbose=0, epochs=2)
        assert set(history.history) == {"loss", "skipped_steps", "skipped_steps_total"}
        assert history.history["skipped_steps_total"] == [1.0, 2.0]


def test_telemetry_follows_the_scale_at_each_epoch_end():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kmp.compile(
        model,
        optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=4.0, growth_interval=1),
        loss="mse",
    )
    history = model.fit(
        np.ones((8, 2)), np.ones((8, 1)), batch_size=2, epochs=2, verbose=0
    )
    # The scale doubles every step (growth_interval=1): 4 * 2**4, then 2**8.
    assert history.history["loss_scale"] == [64.0, 1024.0]


def test_evaluate_and_validation_are_unchanged_by_telemetry():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kmp.compile(
        model, optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=8.0), loss="mse"
    )
    x, y = np.ones((8, 2)), np.ones((8, 1))
    history = model.fit(x, y, validation_data=(x, y), verbose=0)
    assert set(history.history) == {
        "loss",
        "loss_scale",
        "skipped_steps",
        "skipped_steps_total",
        "val_loss",
    }
    result = model.evaluate(x, y, verbose=0)
    assert isinstance(result, float)  # a single loss, as without kmp


def test_telemetry_with_several_steps_per_execution():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kmp.compile(
        model,
        optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=8.0, growth_interval=1),
        loss="mse",
        steps_per_execution=4,
    )
    history = model.fit(np.ones((16, 2)), np.ones((16, 1)), batch_size=2, verbose=0)
    assert history.history["loss_scale"] == [8.0 * 2**8]


def hidden_mlp():
    return keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(4), keras.layers.Dense(1)]
    )


def test_evaluate_in_eager_mode_returns_no_telemetry():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(hidden_mlp(), optimizer="sgd", loss="mse", run_eagerly=True)
    x, y = np.ones((8, 2)), np.ones((8, 1))
    history = model.fit(x, y, batch_size=4, verbose=0)
    assert "loss_scale" in history.history
    result = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(result) == {"loss"}


def test_attach_after_training_takes_effect_at_the_next_fit():
    kmp.set_policy("mixed_float16")
    model = hidden_mlp()
    model.compile(optimizer=kmp.LossScaleOptimizer("sgd"), loss="mse")
    x, y = np.ones((8, 2)), np.ones((8, 1))
    assert "loss_scale" not in model.fit(x, y, verbose=0).history
    kmp.telemetry.attach(model)
    assert "loss_scale" in model.fit(x, y, verbose=0).history


def test_attach_works_after_load_model(tmp_path):
    kmp.set_policy("mixed_float16")
    model = kmp.compile(hidden_mlp(), optimizer="sgd", loss="mse")
    x, y = np.ones((8, 2)), np.ones((8, 1))
    model.fit(x, y, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded.fit(x, y, verbose=0)  # trained once without telemetry
    kmp.telemetry.attach(loaded)
    history = loaded.fit(x, y, verbose=0)
    assert history.history["skipped_steps_total"] == [0.0]


def test_history_shows_the_scale_of_keras_own_wrapper():
    kmp.set_policy("mixed_float16")
    model = hidden_mlp()
    model.compile(optimizer="sgd", loss="mse")  # Keras wraps it in its own
    kmp.telemetry.attach(model)
    x, y = np.ones((8, 2)), np.ones((8, 1))
    history = model.fit(x, y, verbose=0)
    assert history.history["loss_scale"] == [float(model.optimizer.dynamic_scale)]
    assert "skipped_steps" not in history.history  # Keras counts none
    assert set(model.evaluate(x, y, verbose=0, return_dict=True)) == {"loss"}
