import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp.scaling.telemetry import LossScaleTelemetry


def test_attach_is_idempotent_and_reports_nothing_without_kmp_optimizer():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    kmp.telemetry.attach(model)
    kmp.telemetry.attach(model)
    telemetry = [m for m in model.metrics if isinstance(m, LossScaleTelemetry)]
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
        assert set(history.history) == {
            "loss",
            "applied_loss",
            "skipped_steps",
            "skipped_steps_total",
        }
        assert history.history["skipped_steps_total"] == [1.0, 2.0]


def test_telemetry_follows_the_scale_at_each_epoch_end():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kmp.compile(
        model,
        optimizer=kmp.LossScaleOptimizer(
            "sgd", initial_scale=4.0, dynamic_growth_steps=1
        ),
        loss="mse",
    )
    history = model.fit(
        np.ones((8, 2)), np.ones((8, 1)), batch_size=2, epochs=2, verbose=0
    )
    # The scale doubles every step (dynamic_growth_steps=1): 4 * 2**4, then 2**8.
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
        "applied_loss",
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
        optimizer=kmp.LossScaleOptimizer(
            "sgd", initial_scale=8.0, dynamic_growth_steps=1
        ),
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


def overflowing_batches():
    """8 batches of 8; batch 3 holds 1e30, which overflows float16."""
    rng = np.random.default_rng(0)
    x = rng.random((64, 4)).astype("float32")
    y = rng.random((64, 1)).astype("float32")
    x[20] = 1e30
    return x, y


def small_regression():
    """Its head in float32: only the batch of 1e30 overflows, not a float16
    bias gradient summed over a batch at the first scale."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def test_loss_stays_keras_own_and_applied_loss_is_the_mean_of_applied_steps(capsys):
    kmp.set_policy("mixed_float16")
    x, y = overflowing_batches()
    # Plain Keras: the skipped step's loss makes the epoch's loss NaN.
    plain = small_regression()
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    assert np.isnan(
        plain.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"][0]
    )

    model = small_regression()
    # Learning rate 0: the weights stay put, so each batch's loss is known.
    kmp.compile(model, optimizer=keras.optimizers.SGD(0.0), loss="mse")
    history = model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=2,
        validation_data=(x[:8], y[:8]),
    )  # fmt: skip
    line = capsys.readouterr().out
    applied = [
        model.evaluate(x[i : i + 8], y[i : i + 8], verbose=0)
        for i in range(0, 64, 8)
        if i != 16
    ]
    assert history.history["skipped_steps"] == [1.0, 1.0]
    # `loss` is what plain Keras logs: the skipped step's NaN counts in it.
    assert np.isnan(history.history["loss"]).all()
    # Each epoch's own applied steps (the count restarts at each epoch, and
    # validation in between changes nothing).
    assert history.history["applied_loss"] == pytest.approx(
        [np.mean(applied)] * 2, rel=1e-3
    )
    assert np.isfinite(history.history["val_loss"]).all()
    assert "val_applied_loss" not in history.history
    assert " loss: nan" in line and "applied_loss: " in line
    assert "skipped_steps: 1" in line


def test_an_epoch_without_skips_keeps_keras_own_loss():
    kmp.set_policy("mixed_float16")
    x, y = overflowing_batches()
    x[20] = 0.5
    model = small_regression()
    kmp.compile(model, optimizer="sgd", loss="mse")
    history = model.fit(x[:60], y[:60], batch_size=8, shuffle=False, verbose=0)
    assert history.history["skipped_steps"] == [0.0]
    tracker = next(m for m in model.metrics if m.name == "loss")
    # Bit-identical to Keras's mean (its last batch of 4 weighted by size).
    assert history.history["loss"][0] == float(tracker.result())


def test_a_step_skipped_for_its_gradients_alone_keeps_keras_own_loss():
    # The scale's ceiling overflows float16 gradients while the loss is
    # finite: Keras's mean stays finite, so it stays as it is.
    kmp.set_policy("mixed_float16")
    x, y = overflowing_batches()
    x[20] = 0.5
    model = small_regression()
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=2.0**24, max_scale=2.0**24
    )
    kmp.compile(model, optimizer=opt, loss="mse")
    history = model.fit(x * 100, y * 1e4, batch_size=8, shuffle=False, verbose=0)
    assert history.history["skipped_steps"][0] >= 1
    tracker = next(m for m in model.metrics if m.name == "loss")
    assert np.isfinite(float(tracker.result()))
    assert history.history["loss"][0] == float(tracker.result())


def test_the_applied_loss_variables_come_after_every_other_optimizer_variable():
    # A tf.train.Checkpoint stores optimizer variables by position: the ones
    # added for the applied loss must not move those before them.
    kmp.set_policy("mixed_float16")
    model = small_regression()
    kmp.compile(model, optimizer="adam", loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    opt = model.optimizer
    inner = {id(v) for v in opt.inner_optimizer.variables}
    names = [v.name for v in opt.variables if id(v) not in inner]
    assert len(names) > 4 and names[-4:] == [
        "step_loss",
        "step_loss_recorded",
        "applied_loss_total",
        "applied_loss_steps",
    ]


def test_the_graph_check_sees_keras_own_wrapper_update_its_scale_when_traced():
    # Inside a tf.function the graph holds the scale's handle as a captured
    # placeholder, in nested functions too: a train step assigns it, an
    # evaluation step does not.
    import tensorflow as tf

    from kmp.backend import graph

    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    variable = keras.Variable(np.ones(2, "float32"))
    opt.build([variable])
    seen = {}

    @tf.function
    def inner_train():
        opt.apply([tf.ones(2)], [variable])
        seen["train"] = graph.assigned_here(opt.dynamic_scale)

    @tf.function
    def train():
        inner_train()
        seen["outer train"] = graph.assigned_here(opt.dynamic_scale)

    @tf.function
    def evaluate():
        seen["evaluate"] = graph.assigned_here(opt.dynamic_scale)
        return variable + 1.0

    train()
    evaluate()
    assert seen == {"train": True, "outer train": True, "evaluate": False}


class TwoOptimizerModel(keras.Model):
    """A model whose own compile takes its optimizers, and whose train_step
    applies them (keras-io's DCGAN, reduced)."""

    def __init__(self):
        super().__init__()
        self.d = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        self.g = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, x):
        import tensorflow as tf

        for optimizer, net, loss_of in (
            (self.d_optimizer, self.d, lambda: self.d(x)),
            (self.g_optimizer, self.g, lambda: self.d(self.g(x))),
        ):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(loss_of()))
                scaled = optimizer.scale_loss(loss)
            weights = net.trainable_weights
            optimizer.apply(tape.gradient(scaled, weights), weights)
        return {"loss": loss}


def _compiled_by_hand(policy="mixed_float16"):
    """The README's path for a model compiled without kmp.compile."""
    kmp.set_policy(policy)
    model = kmp.prepare(TwoOptimizerModel())
    model.compile(
        d_optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD()),
        g_optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD()),
    )
    return model


def test_attach_reports_the_optimizers_a_models_own_compile_takes(caplog):
    model = _compiled_by_hand()
    kmp.telemetry.attach(
        model, optimizers={"d": model.d_optimizer, "g": model.g_optimizer}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            np.ones((8, 4), "float32"),
            epochs=2,
            batch_size=4,
            verbose=0,
            callbacks=[kmp.callbacks.LossScaleMonitor()],
        )
    assert not [w for w in caught if "kmp's telemetry" in str(w.message)]
    for label in ("d", "g"):
        assert history.history[f"{label}_loss_scale"] == [32768.0, 32768.0]
        assert history.history[f"{label}_skipped_steps_total"] == [0.0, 0.0]
    # Not taken for a model trained with Keras's own wrapper.
    assert "compiled with model.compile" not in caplog.text


def test_a_kmp_optimizer_the_telemetry_does_not_report_is_warned_about():
    # model.optimizer is the default super().compile() made, never used.
    model = _compiled_by_hand()
    kmp.telemetry.attach(model)
    with pytest.warns(UserWarning, match=r"attach\(model, optimizers=") as caught:
        history = model.fit(np.ones((8, 4), "float32"), batch_size=4, verbose=0)
    said = [str(w.message) for w in caught if "kmp's telemetry" in str(w.message)]
    assert len(said) == 1
    applied = "a kmp.LossScaleOptimizer around SGD"
    assert f"applied {applied}, {applied}, which" in said[0]
    assert "reads optimizer: Keras's own LossScaleOptimizer around RMSprop" in said[0]
    assert "loss_scale" not in history.history  # what the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first step only
        model.fit(np.ones((8, 4), "float32"), batch_size=4, verbose=0)


def test_optimizers_named_after_training_are_logged_and_checked_from_the_next_fit():
    # Under bfloat16 model.optimizer is super().compile()'s bare RMSprop:
    # the first fit has nothing to log for it.
    model = _compiled_by_hand("mixed_bfloat16")
    kmp.telemetry.attach(model)
    x = np.ones((8, 4), "float32")
    with pytest.warns(UserWarning, match="kmp's telemetry does not report"):
        assert set(model.fit(x, batch_size=4, verbose=0).history) == {"loss"}
    kmp.telemetry.attach(
        model, optimizers={"d": model.d_optimizer, "g": model.g_optimizer}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both reported now: nothing to say
        history = model.fit(x, batch_size=4, verbose=0)
    assert history.history["d_loss_scale"] == [32768.0]
    assert history.history["g_skipped_steps_total"] == [0.0]
    # Named wrongly again: checked again at the next step.
    kmp.telemetry.attach(model, optimizers={"d": model.d_optimizer})
    with pytest.warns(UserWarning, match="kmp's telemetry does not report"):
        model.fit(x, batch_size=4, verbose=0)


def test_attach_refuses_the_optimizer_kmp_compile_wrapped_in_place_of_its_wrapper():
    kmp.set_policy("mixed_float16")
    model = TwoOptimizerModel()
    d_optimizer = keras.optimizers.SGD()
    kmp.compile(model, d_optimizer=d_optimizer, g_optimizer=keras.optimizers.SGD())
    with pytest.raises(ValueError, match=r"Pass the wrapper \(as 'd_optimizer'"):
        kmp.telemetry.attach(model, optimizers={"d_optimizer": d_optimizer})


def test_applies_recorded_in_each_other_keep_their_own_lists():
    from kmp.scaling import applies

    opt, w = kmp.LossScaleOptimizer(keras.optimizers.SGD()), keras.Variable([1.0])
    with applies.recorded() as outer:
        with applies.recorded() as inner:  # equal to outer: both empty
            pass
        opt.apply([keras.ops.ones((1,))], [w], scaled=False)
    assert outer == [opt] and inner == []


@pytest.mark.parametrize(
    "optimizers, said",
    [
        ([keras.optimizers.SGD()], "non-empty dict"),
        ({}, "non-empty dict"),
        ({"d": "sgd"}, "Received 'd': 'sgd' \\(of type str\\)"),
        ({"d/1": keras.optimizers.SGD()}, "a Python identifier"),
    ],
)
def test_attach_refuses_optimizers_that_are_not_named_keras_optimizers(
    optimizers, said
):
    model = _compiled_by_hand()
    with pytest.raises((TypeError, ValueError), match=said):
        kmp.telemetry.attach(model, optimizers=optimizers)
