"""A run that trains nothing stops loudly by default (kmp.training.stall)."""

import keras
import numpy as np
import pytest

import kmp
from kmp.training import stall


def mlp(activation=None):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation=activation),
            keras.layers.Dense(1),
        ]
    )


def overflowing(n=96):
    """Inputs that overflow float16 (max 65504) in the forward pass."""
    return np.full((n, 4), 1e5, "float32"), np.ones((n, 1), "float32")


def test_a_float16_run_whose_every_step_overflows_raises():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    x, y = overflowing()
    with pytest.raises(kmp.callbacks.TrainingCollapsedError) as caught:
        model.fit(x, y, batch_size=1, epochs=3, verbose=0)
    error = caught.value
    assert error.cause == "forward"
    assert "loss scale at its floor (1)" in str(error)
    assert "kmp.debug.find_nonfinite(model, x_batch)" in str(error)
    opt = model.optimizer
    # 15 skips halve 2**15 to the floor, 1; the 16th, at the floor, stops it.
    assert int(opt.skipped_steps_total) == 16
    assert int(opt.consecutive_skips) >= stall.STALLED_AFTER
    assert float(opt.loss_scale) == opt.config.min_scale
    for weight, initial in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(weight, initial)


def test_a_bfloat16_run_whose_nan_inputs_a_relu_hides_raises():
    # The loss stays finite and flat while every step is skipped.
    kmp.set_policy("mixed_bfloat16")
    model = kmp.compile(mlp("relu"), optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).random((64, 4)).astype("float32")
    x[:, 0] = np.nan
    with pytest.raises(kmp.callbacks.TrainingCollapsedError) as caught:
        model.fit(x, np.ones((64, 1)), batch_size=4, epochs=6, verbose=0)
    assert caught.value.cause == "gradient"
    assert "without loss scaling" in str(caught.value)
    assert int(model.optimizer.skipped_steps_total) == stall.STALLED_AFTER


def test_skips_while_the_scale_still_falls_do_not_stop_the_run():
    kmp.set_policy("mixed_float16")
    opt = kmp.LossScaleOptimizer("sgd", min_scale=2.0**-20)
    model = kmp.compile(mlp(), optimizer=opt, loss="mse")
    x, y = overflowing(30)  # 2**15 halves 30 times: still above 2**-20
    history = model.fit(x, y, batch_size=1, verbose=0)
    assert history.history["skipped_steps"] == [30]
    assert float(opt.loss_scale) > opt.config.min_scale  # precondition


def test_a_non_finite_guard_in_callbacks_takes_the_check_over():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), optimizer="sgd", loss="mse")
    x, y = overflowing()
    guard = kmp.callbacks.NonFiniteGuard(on_collapse="warn")
    history = model.fit(x, y, batch_size=3, epochs=3, verbose=0, callbacks=[guard])
    assert history.history["skipped_steps"] == [32, 32, 32]
    assert guard.diagnosis is not None and guard.diagnosis.cause == "forward"
    # The next fit without the guard is checked again.
    with pytest.raises(kmp.callbacks.TrainingCollapsedError):
        model.fit(x, y, batch_size=1, verbose=0)


def test_the_guard_that_raised_gives_the_check_back():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), optimizer="sgd", loss="mse")
    x, y = overflowing()
    guard = kmp.callbacks.NonFiniteGuard(max_consecutive_skips=40)
    with pytest.raises(kmp.callbacks.TrainingCollapsedError):
        model.fit(x, y, batch_size=1, verbose=0, callbacks=[guard])
    assert int(model.optimizer.consecutive_skips) == 40  # the guard's, not 10
    with pytest.raises(kmp.callbacks.TrainingCollapsedError) as caught:
        model.fit(x, y, batch_size=1, verbose=0)
    assert caught.value is not guard.diagnosis


def test_a_fit_interrupted_with_a_guard_gives_the_check_back():
    # The guard's on_train_end never runs when its fit is interrupted; the
    # guard, still held, must not keep kmp's check off for later fits.
    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyboardInterrupt

    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), optimizer="sgd", loss="mse")
    x, y = overflowing()
    guard = kmp.callbacks.NonFiniteGuard(on_collapse="warn")
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=1, verbose=0, callbacks=[guard, Interrupt()])
    with pytest.raises(kmp.callbacks.TrainingCollapsedError):
        model.fit(x, y, batch_size=1, verbose=0)
    assert guard is not None  # held until here


def test_a_floor_float32_cannot_hold_exactly_is_still_the_floor():
    kmp.set_policy("mixed_float16")
    opt = kmp.LossScaleOptimizer("sgd", initial_scale=2.0, min_scale=0.1)
    model = kmp.compile(mlp(), optimizer=opt, loss="mse")
    x, y = overflowing(40)
    with pytest.raises(kmp.callbacks.TrainingCollapsedError, match="floor"):
        model.fit(x, y, batch_size=1, verbose=0)
    # 2 -> 1 -> 0.5 -> 0.25 -> 0.125 -> 0.1 (float32: 0.100000001...), then
    # skipped there until 10 in a row, and one more at the floor.
    assert int(opt.skipped_steps_total) == 11


def test_a_static_scale_stops_after_ten_skips():
    kmp.set_policy("mixed_float16")
    opt = kmp.LossScaleOptimizer("sgd", initial_scale=8.0, mode="static")
    model = kmp.compile(mlp(), optimizer=opt, loss="mse")
    x, y = overflowing(40)
    with pytest.raises(kmp.callbacks.TrainingCollapsedError, match="static"):
        model.fit(x, y, batch_size=1, verbose=0)
    assert int(opt.skipped_steps_total) == stall.STALLED_AFTER
