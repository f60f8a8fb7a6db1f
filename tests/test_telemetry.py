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


def test_kmp_compile_logs_telemetry_under_bfloat16_too():
    kmp.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kmp.compile(model, optimizer=kmp.LossScaleOptimizer("sgd"), loss="mse")
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, epochs=2)
    assert history.history["loss_scale"] == [1.0, 1.0]  # pass-through
    assert history.history["skipped_steps_total"] == [0.0, 0.0]


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
