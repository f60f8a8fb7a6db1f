"""kmp.callbacks.OverflowHealer: a layer whose forward pass overflows
float16 moves to float32 while `fit` runs, the loss scale untouched by
those overflows, the move kept by `model.save`."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.scaling import config as ls_config
from kmp.scaling import state as state_lib


def ffn_model(up_scale: float = 1e4) -> keras.Model:
    """Dense up, its weights scaled up as weights pretrained in bfloat16 can
    be (its output overflows float16), a LayerNormalization that brings the
    values back in range, Dense down, Dense head. Float32 trains it."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    y = keras.layers.Dense(16, activation="relu", name="down")(h)
    outputs = keras.layers.Dense(4, name="head")(y)
    model = keras.Model(inputs, outputs, name="ffn")
    up = model.get_layer("up")
    up.kernel.assign(up.kernel * up_scale)
    return model


def data(n: int = 256):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 16)).astype("float32") * 4
    return x, (x @ rng.normal(size=(16, 4)).astype("float32")) / 4


def scale_of(model) -> float:
    return float(keras.ops.convert_to_numpy(model.optimizer.loss_scale))


def test_the_healer_moves_the_overflowing_layers_and_training_goes_on(tmp_path):
    x, y = data()
    kmp.set_policy("mixed_float16")
    # Without the healer every step is skipped: the scale falls to its floor,
    # and fit stops.
    plain = kmp.compile(ffn_model(), optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    with pytest.raises(kmp.callbacks.TrainingCollapsedError, match="forward pass"):
        plain.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert int(plain.optimizer.skipped_steps_total) == 16  # one at the floor, 1
    assert scale_of(plain) == plain.optimizer.config.min_scale

    model = kmp.compile(ffn_model(), optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    initial = scale_of(model)
    # Evaluated before: Keras keeps that test function, traced with 'up' in
    # float16, unless the heal has it made again.
    assert not np.isfinite(model.evaluate(x, y, verbose=0))
    healer = kmp.callbacks.OverflowHealer(verbose=0)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[healer])
    assert np.isfinite(model.evaluate(x, y, verbose=0))
    # 'up' overflows; in float32, its output goes to the LayerNormalization,
    # which takes it as it comes and normalizes it: nothing else moves.
    assert [h.layer for h in healer.heals] == ["up"]
    assert healer.heals[-1].step <= 50
    assert model.get_layer("up").compute_dtype == "float32"
    assert model.get_layer("norm").compute_dtype == "float16"
    # Only the steps before each move were lost, and forward overflows did
    # not lower the scale.
    assert healer.forward_overflows == int(model.optimizer.skipped_steps_total) <= 8
    assert scale_of(model) >= initial
    assert history.history["healed_layers"] == [1.0, 1.0, 1.0]
    losses = history.history["applied_loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    # Within a few percent of float32 training the same model (the steps
    # lost before the move aside).
    kmp.set_policy("float32")
    reference = ffn_model()
    reference.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    expected = reference.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert losses[-1] == pytest.approx(expected.history["loss"][-1], rel=0.1)
    kmp.set_policy("mixed_float16")
    assert "healed at step" in str(healer.heals[0])
    # What overflowed float16: measured in float32 in the step after the move.
    assert healer.heals[0].magnitude > 65504
    assert f"reached {healer.heals[0].magnitude:.3g}" in str(healer.heals[0])
    assert kmp.precision_report(model).row("up").rule == str(healer.heals[0])
    # A later kmp.prepare keeps the move, as it keeps a user's dtype=.
    kmp.prepare(model)
    assert model.get_layer("up").compute_dtype == "float32"

    # Saved and loaded: the healed precision stays, and training resumes
    # without a new overflow.
    path = str(tmp_path / "healed.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("up").compute_dtype == "float32"
    again = kmp.callbacks.OverflowHealer(verbose=0)
    loaded.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[again])
    assert again.forward_overflows == 0 and not again.heals


def test_an_exported_healed_model_serves_with_the_healed_precision(tmp_path):
    x, y = data(64)
    kmp.set_policy("mixed_float16")
    model = kmp.compile(ffn_model(), optimizer="adam", loss="mse")
    # Exported before the heal, 'up' overflows float16: the served output
    # is not finite.
    model.export(str(tmp_path / "before"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "before"))  # held while served
    assert not np.isfinite(loaded.serve(x).numpy()).all()
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[healer])
    assert [h.layer for h in healer.heals] == ["up"]
    model.export(str(tmp_path / "after"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "after"))
    served = loaded.serve(x).numpy()
    assert np.isfinite(served).all()
    np.testing.assert_allclose(
        served, model.predict(x, verbose=0), rtol=1e-2, atol=1e-2
    )


def test_plain_keras_does_not_train_on_the_same_model():
    x, y = data()
    kmp.set_policy("mixed_float16")
    model = ffn_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert not np.isfinite(history.history["loss"][-1])


def test_an_overflow_outside_every_layer_is_reported_and_the_scale_falls_again():
    x, y = data()
    kmp.set_policy("mixed_float16")

    def float16_loss(y_true, y_pred):  # overflows in the loss, not in a layer
        return keras.ops.mean(keras.ops.square(keras.ops.cast(y_pred, "float16") * 1e4))

    model = kmp.compile(ffn_model(1.0), optimizer="adam", loss=float16_loss)
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    with pytest.warns(UserWarning, match="outside every layer"):
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[healer])
    assert healer.gave_up and not healer.heals
    assert scale_of(model) < model.optimizer.config.initial_scale


def test_a_train_step_that_never_scales_its_loss_is_refused():
    class OwnStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables, scaled=False)
            return {"loss": loss}

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((16,))
    model = OwnStep(inputs, keras.layers.Dense(4)(inputs))
    kmp.compile(model, optimizer="adam", loss="mse")
    x, y = data(64)
    with pytest.raises(ValueError, match="scale_loss"):
        model.fit(x, y, verbose=0, callbacks=[kmp.callbacks.OverflowHealer(verbose=0)])


def test_the_healer_refuses_a_model_that_runs_eagerly():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(ffn_model(), optimizer="adam", loss="mse", run_eagerly=True)
    x, y = data(32)
    with pytest.raises(ValueError, match="run_eagerly"):
        model.fit(x, y, verbose=0, callbacks=[kmp.callbacks.OverflowHealer()])


def test_the_healer_refuses_bad_settings_and_a_model_without_kmp_scaling():
    with pytest.raises(ValueError, match="at least 1"):
        kmp.callbacks.OverflowHealer(overflows=0)
    with pytest.raises(ValueError, match="at least overflows"):
        kmp.callbacks.OverflowHealer(overflows=5, window=3)
    model = ffn_model(1.0)
    model.compile(optimizer="adam", loss="mse")
    x, y = data(32)
    with pytest.raises(ValueError, match=r"kmp\.LossScaleOptimizer"):
        model.fit(x, y, verbose=0, callbacks=[kmp.callbacks.OverflowHealer()])


def test_a_kept_scale_skips_and_counts_but_leaves_the_scale():
    config = ls_config.LossScaleConfig(initial_scale=1024.0, hysteresis=1)
    state = state_lib.LossScaleState.initial(config)
    kept = state_lib.next_state(config, state, False, keep_scale=True)
    lowered = state_lib.next_state(config, state, False)
    assert float(kept.scale) == 1024.0 and float(lowered.scale) == 512.0
    assert int(kept.skipped_total) == int(lowered.skipped_total) == 1
    assert int(kept.consecutive_skips) == 1 and not bool(kept.last_finite)
    # keep_scale changes nothing on a finite step.
    grown = state_lib.next_state(config, state, True, keep_scale=True)
    plain = state_lib.next_state(config, state, True)
    assert [float(v) for v in grown.fields()] == [float(v) for v in plain.fields()]


class _StopAt(keras.callbacks.Callback):
    """Interrupts fit after a number of steps, as a KeyboardInterrupt or a
    failing callback would: on_train_end never runs."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 >= self.steps:
            raise KeyboardInterrupt


def test_a_fit_interrupted_while_healing_leaves_no_watch_on_the_next_fit():
    x, y = data()
    kmp.set_policy("mixed_float16")
    model = kmp.compile(ffn_model(), optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=5, verbose=0)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=32, verbose=0, callbacks=[healer, _StopAt(2)])
    assert healer.forward_overflows == 2 and not healer.heals
    # Without the healer, forward overflows lower the scale again, as they
    # do for a model that never met it.
    before = scale_of(model)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert scale_of(model) < before
    assert model.optimizer._forward_watch is None  # the later fit ended it


def test_with_several_steps_per_execution_every_step_is_counted():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(256, 16)).astype("float32")
    # The first batch of every four overflows 'up' (inputs 1e6 times as large).
    for start in range(0, 256, 128):
        x[start : start + 32] *= 1e6
    y = np.zeros((256, 4), "float32")
    kmp.set_policy("mixed_float16")
    model = kmp.compile(
        ffn_model(1.0), optimizer="adam", loss="mse", steps_per_execution=4
    )
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[healer])
    # Each call runs four steps and only its first overflows: the healer
    # counts it, and the probe it traces in after the first call keeps the
    # second call's, although each call's last step is finite.
    assert [h.layer for h in healer.heals] == ["up"]
    assert healer.heals[0].step == 8
    assert healer.forward_overflows == 2


class CastsBack(keras.layers.Layer):
    """Computes in float32 inside its call and casts its result back to its
    compute dtype (as layers written for mixed precision do): the cast
    itself overflows float16."""

    def call(self, x):
        y = tf.cast(x, "float32") * 1e6
        return tf.cast(y, self.compute_dtype)


def test_a_cast_in_a_layer_s_own_call_is_blamed_on_that_layer():
    x, y = data(64)
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((16,))
    h = CastsBack(name="casts")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    model = kmp.compile(model, optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[healer])
    # 'casts' moves (its float32 output then goes to 'norm', which takes it
    # in float32): not 'norm', which consumes the cast.
    assert [h.layer for h in healer.heals] == ["casts"]
    assert not healer.gave_up
    assert np.isfinite(model.evaluate(x, y, verbose=0))


class Residual(keras.layers.Layer):
    """A block whose own call adds its input to its sublayer's output in raw
    TensorFlow: the two must have one dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(16, name="up")

    def call(self, x):
        return x + self.up(x)


def test_a_move_whose_step_cannot_trace_moves_the_enclosing_block_instead():
    x, y = data(128)
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((16,))
    block = Residual(name="block")
    h = block(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    block.up.kernel.assign(block.up.kernel * 1e5)
    model = kmp.compile(model, optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[healer])
    # 'block/up' alone in float32 would leave the block adding float32 to
    # float16 (read from one trace before anything moves): the block, whose
    # code that is, moves with the layers inside it.
    assert [(h.layer, h.sublayers) for h in healer.heals] == [("block", True)]
    assert block.compute_dtype == block.up.compute_dtype == "float32"
    assert not healer.gave_up
    assert (
        "with the layers inside it" in kmp.precision_report(model).row("block/up").rule
    )
    assert np.isfinite(history.history["applied_loss"]).all()


def test_a_move_is_checked_at_once_so_validation_right_after_it_runs(tmp_path):
    x, y = data(64)
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((16,))
    block = Residual(name="block")
    h = keras.layers.LayerNormalization(name="norm")(block(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    block.up.kernel.assign(block.up.kernel * 1e5)
    model = kmp.compile(model, optimizer="adam", loss="mse")
    record = tmp_path / "heals.json"
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0, path=record)
    # One step per epoch: the move after it is followed by validation, not
    # by a training step. 'block/up' alone in float32 would leave a forward
    # pass that cannot be traced: it never moves, and is never written to
    # the record.
    history = model.fit(
        x,
        y,
        batch_size=64,
        epochs=2,
        validation_data=(x, y),
        verbose=0,
        callbacks=[healer],
    )
    assert [(h.layer, h.sublayers) for h in healer.heals] == [("block", True)]
    assert json.loads(record.read_text())["heals"][0]["layer"] == "block"
    assert len(json.loads(record.read_text())["heals"]) == 1
    assert np.isfinite(history.history["val_loss"][-1])


def one_move_record(tmp_path, layer: str):
    """A healer's record file that moves `layer`, and its entry."""
    record = tmp_path / "heals.json"
    entry = {"layer": layer, "step": 3, "op": "MatMul", "overflows": 1}
    record.write_text(json.dumps({"heals": [entry]}))
    return record, entry


def test_a_record_whose_moves_the_model_cannot_trace_is_left_out(tmp_path):
    x, y = data(64)
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((16,))
    block = Residual(name="block")
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(block(inputs)))
    model = kmp.compile(model, optimizer="adam", loss="mse")
    record, entry = one_move_record(tmp_path, "block/up")
    healer = kmp.callbacks.OverflowHealer(verbose=0, path=record)
    with pytest.warns(UserWarning, match="left out"):
        history = model.fit(x, y, batch_size=16, verbose=0, callbacks=[healer])
    assert block.up.compute_dtype == "float16" and not healer.heals
    assert np.isfinite(history.history["loss"]).all()
    # A move to a dtype the healer does not make is refused with the fix.
    record.write_text(json.dumps({"heals": [{**entry, "dtype": "float8"}]}))
    with pytest.raises(ValueError, match=r"'float8'.*delete it"):
        model.fit(
            x,
            y,
            verbose=0,
            callbacks=[kmp.callbacks.OverflowHealer(verbose=0, path=record)],
        )


class OwnResidual(keras.Model):
    """A subclassed model whose own call adds in raw TensorFlow."""

    def __init__(self):
        super().__init__()
        self.up = keras.layers.Dense(16, name="up")
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        return self.head(x + self.up(x))


def test_a_move_no_enclosing_layer_can_take_is_not_made_and_said():
    x, y = data(128)
    kmp.set_policy("mixed_float16")
    model = OwnResidual()
    model(x[:1])
    model.up.kernel.assign(model.up.kernel * 1e5)
    model = kmp.compile(model, optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    with pytest.warns(UserWarning, match=r"\(AddV2 in OwnResidual\).*can move"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[healer])
    # The add is the model's own code, read from one trace before anything
    # moves: no layer to move, and the overflows lower the scale again.
    assert healer.gave_up and not healer.heals
    assert model.up.compute_dtype == "float16"
    assert "healed" not in kmp.precision_report(model).row("up").rule
    assert scale_of(model) < model.optimizer.config.initial_scale


def test_a_model_compiled_by_keras_with_kmp_s_optimizer_is_healed_too():
    x, y = data(128)
    kmp.set_policy("mixed_float16")
    model = ffn_model()
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[healer])
    assert [h.layer for h in healer.heals] == ["up"]
    assert np.isfinite(model.evaluate(x, y, verbose=0))


@pytest.mark.parametrize("machine_policy", ["mixed_bfloat16", "float32"])
def test_a_layer_moves_to_bfloat16_where_asked_or_where_auto_finds_it_native(
    monkeypatch, machine_policy
):
    from kmp.backend import machine
    from kmp.precision import auto

    x, y = data(128)
    kmp.set_policy("mixed_float16")
    model = kmp.compile(ffn_model(), optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0, to="bfloat16")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[healer])
    # bfloat16 has float32's range: the overflow is gone, in 16 bits.
    assert [(h.layer, h.dtype) for h in healer.heals] == [("up", "bfloat16")]
    assert model.get_layer("up").compute_dtype == "bfloat16"
    assert model.get_layer("up").variable_dtype == "float32"
    assert "moved to bfloat16" in kmp.precision_report(model).row("up").rule
    assert healer.heals[0].magnitude > 65504
    assert np.isfinite(model.evaluate(x, y, verbose=0))

    # 'auto': bfloat16 where the machine's 'auto' policy is bfloat16.
    monkeypatch.setattr(
        machine, "resolve_auto", lambda: auto.AutoChoice(machine_policy, "a fake")
    )
    model = kmp.compile(ffn_model(), optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0, to="auto")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[healer])
    expected = "bfloat16" if machine_policy == "mixed_bfloat16" else "float32"
    assert [h.dtype for h in healer.heals] == [expected]
    assert model.get_layer("up").compute_dtype == expected
    with pytest.raises(ValueError, match="'float32', 'bfloat16', 'auto'"):
        kmp.callbacks.OverflowHealer(to="float16")


class _StopAtEpoch(keras.callbacks.Callback):
    """Interrupts fit at the start of an epoch, as a preempted job stops."""

    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("preempted")


def test_a_resumed_run_starts_with_the_layers_moved_and_no_new_overflow(tmp_path):
    x, y = data()
    kmp.set_policy("mixed_float16")
    record = tmp_path / "heals.json"
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = kmp.compile(ffn_model(), optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0, path=record)
    with pytest.raises(RuntimeError, match="preempted"):
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=3,
            verbose=0,
            callbacks=[healer, backup, _StopAtEpoch(1)],
        )
    assert [h.layer for h in healer.heals] == ["up"] and record.exists()
    # A fresh start: the model rebuilt by the same code (its 'up' in
    # float16 again), weights and optimizer state from the backup, the
    # moves from the healer's record, before the first step.
    rebuilt = kmp.compile(ffn_model(), optimizer="adam", loss="mse")
    assert rebuilt.get_layer("up").compute_dtype == "float16"
    again = kmp.callbacks.OverflowHealer(overflows=1, verbose=0, path=record)
    monitor = kmp.callbacks.LossScaleMonitor()
    history = rebuilt.fit(
        x, y, batch_size=32, epochs=3, verbose=0, callbacks=[again, backup, monitor]
    )
    # The monitor records the move made again, once its first step ran.
    assert [r.healed for r in monitor.records if r.healed] == [(str(healer.heals[0]),)]
    assert len(history.history["loss"]) == 2  # resumed at epoch 2
    assert rebuilt.get_layer("up").compute_dtype == "float32"
    assert again.forward_overflows == 0
    assert again.heals == healer.heals and again.heals[0].magnitude > 65504
    assert "healed at step" in kmp.precision_report(rebuilt).row("up").rule
    assert np.isfinite(history.history["loss"]).all()
    # A record of another model is said, not applied blindly.
    other = kmp.compile(ffn_model(1.0), optimizer="adam", loss="mse")
    record.write_text(record.read_text().replace('"up"', '"gone"'))
    with pytest.warns(UserWarning, match="does not have: gone"):
        other.fit(
            x,
            y,
            epochs=1,
            verbose=0,
            callbacks=[kmp.callbacks.OverflowHealer(verbose=0, path=record)],
        )
    with pytest.raises(ValueError, match="folder does not exist"):
        kmp.callbacks.OverflowHealer(path=tmp_path / "no" / "heals.json")


@pytest.mark.slow
def test_a_keras_hub_llama_whose_feed_forward_overflows_heals_and_trains():
    keras_hub = pytest.importorskip("keras_hub")
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    vocab = 64
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=vocab,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    # The first block's gate and up projections scaled up, as weights
    # pretrained in bfloat16 can be: their product (the block's own code)
    # overflows float16.
    block = backbone.get_layer("transformer_layer_0")
    for dense in (block._feedforward_gate_dense, block._feedforward_intermediate_dense):
        dense.kernel.assign(dense.kernel * 3000.0)
    kmp.compile(
        lm,
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, vocab, (32, 12)).astype("int32"),
        "padding_mask": np.ones((32, 12), "int32"),
    }
    y = np.roll(x["token_ids"], -1, axis=1)
    # Foreseen before training: the audit names the block.
    risks = kmp.debug.precision_audit(lm, sample=x).risks
    # The backbone's name has a suffix where other KerasHub models were
    # built in this process before it.
    block_path = f"{backbone.name}/transformer_layer_0"
    assert block_path in {r.layer for r in risks if r.kind == "float16 overflow"}
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    history = lm.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[healer])
    assert [(h.layer, h.sublayers) for h in healer.heals] == [(block_path, True)]
    assert healer.heals[0].magnitude > 65504 and not healer.gave_up
    assert block._feedforward_gate_dense.compute_dtype == "float32"
    # What is outside the block stays in float16.
    assert backbone.get_layer("sequence_output_layernorm").compute_dtype == "float16"
    assert np.isfinite(history.history["applied_loss"][-1])
    assert healer.forward_overflows == int(lm.optimizer.skipped_steps_total) <= 2


@pytest.mark.slow
def test_the_overflow_healing_example_foresees_diagnoses_heals_and_keeps_the_move():
    import contextlib
    import io
    import pathlib
    import runpy

    path = pathlib.Path(__file__).parent.parent / "examples" / "overflow_healing.py"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    text = out.getvalue()
    # 1: the audit names the layer; 2: the guard names it as a forward
    # overflow; 3: the healer moves it early and the loss falls; 4: the
    # move survives a save and load, with no new overflow.
    audit = text.split("\n2. ")[0]
    assert "ffn_up: its" in audit and "float16's largest value" in audit
    assert "the loss itself is inf/NaN" in text and "layer 'ffn_up'" in text
    assert "'ffn_up' moved to float32" in text
    step = int(text.split("healed at step ")[1].split(":")[0])
    assert step <= 50
    first, last = (
        float(v) for v in text.split("   applied_loss ")[1].split(",")[0].split(" -> ")
    )
    assert last < 0.6 * first
    assert "ffn_up computes in float32; forward overflows after the resume: 0" in text


def test_a_dataset_of_unknown_length_keeps_the_healer_watching_every_epoch():
    x, y = data()
    kmp.set_policy("mixed_float16")
    model = kmp.compile(ffn_model(1.0), optimizer="adam", loss="mse")
    # Unknown length: Keras's last call of each epoch meets the end of data.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)

    class BlowUp(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                up = self.model.get_layer("up")
                up.kernel.assign(up.kernel * 1e5)

    model.fit(dataset.batch(32), epochs=3, verbose=0, callbacks=[BlowUp(), healer])
    assert [h.layer for h in healer.heals] == ["up"]
    assert healer.forward_overflows >= 1


class JoinsInItsStep(keras.Model):
    """A train_step of the model's own that joins 'up''s output with a
    float16 tensor in raw TensorFlow: the forward pass traces with 'up' in
    float32, the training step does not."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            extra = self.get_layer("up")(x) + tf.cast(x[:, :1] * 0, "float16")
            loss = self.compute_loss(x=x, y=y, y_pred=pred)
            loss = loss + tf.cast(tf.reduce_mean(extra) * 0, "float32")
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def joins_in_its_step(up_scale: float) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(16, name="up")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    model = JoinsInItsStep(inputs, keras.layers.Dense(4, name="head")(h))
    up = model.get_layer("up")
    up.kernel.assign(up.kernel * up_scale)
    return kmp.compile(model, optimizer="adam", loss="mse")


def test_a_move_only_the_train_step_refuses_is_said_at_the_next_step():
    x, y = data(32)
    kmp.set_policy("mixed_float16")
    model = joins_in_its_step(1e5)
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    # Two steps: 'up' moves after the second, the last; no step of this fit
    # runs with it.
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[healer])
    assert model.get_layer("up").compute_dtype == "float32"
    # The next step's trace fails in the train_step's own code, which kmp
    # cannot read before it runs: said, with the fix; no retry.
    with pytest.raises(TypeError, match=r"moved 'up'.*Cast in the step"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[healer])


def test_a_recorded_move_only_the_training_step_refuses_is_said(tmp_path):
    x, y = data(64)
    kmp.set_policy("mixed_float16")
    model = joins_in_its_step(1.0)
    record, _ = one_move_record(tmp_path, "up")
    healer = kmp.callbacks.OverflowHealer(verbose=0, path=record)
    # A fresh model's first fit: the move is made again before its first
    # step, whose trace refuses it: said, with the fix.
    with pytest.raises(TypeError, match=r"record .* moved 'up'.*delete the record"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[healer])


def test_a_monitor_listed_before_the_healer_records_a_move_its_last_step_ran():
    x, y = data(48)
    kmp.set_policy("mixed_float16")
    model = kmp.compile(ffn_model(), optimizer="adam", loss="mse")
    healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    monitor = kmp.callbacks.LossScaleMonitor()
    # Three steps: 'up' moves after the second; the third, the last, runs
    # with it, and the monitor's batch end comes before the healer's.
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[monitor, healer])
    assert [h.step for h in healer.heals] == [2]
    assert [r.healed for r in monitor.records if r.healed] == [(str(healer.heals[0]),)]
    assert [r.step for r in monitor.records] == [1, 2, 3]


@keras.saving.register_keras_serializable("kmp_tests")
class FFNBlock(keras.layers.Layer):
    """ffn_model's layers, created by a layer's own code with its dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(64, "relu", name="up", dtype=self.dtype_policy)
        self.norm = keras.layers.LayerNormalization(
            name="norm", dtype=self.dtype_policy
        )
        self.down = keras.layers.Dense(16, name="down", dtype=self.dtype_policy)

    def build(self, shape):
        self.up.build(shape)
        self.norm.build((*shape[:-1], 64))
        self.down.build((*shape[:-1], 64))

    def call(self, x):
        return self.down(self.norm(self.up(x)))

    def get_config(self):  # its own: Keras's automatic one holds no map
        return super().get_config()


def test_a_move_inside_a_layers_own_sublayers_is_saved(tmp_path):
    """The healer moves a layer that a custom layer's code creates: the
    custom layer's saved dtype keeps the move, so it loads moved."""
    x, y = data(128)
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    block = FFNBlock(name="block")
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(block(inputs)))
    block.up.kernel.assign(block.up.kernel * 1e4)
    kmp.compile(model, optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    healer = kmp.callbacks.OverflowHealer(verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[healer])
    assert [h.layer for h in healer.heals] == ["block/up"]
    model.save(tmp_path / "healed.keras")
    loaded = keras.models.load_model(tmp_path / "healed.keras").get_layer("block")
    assert loaded.up.compute_dtype == "float32"
    assert loaded.norm.compute_dtype == loaded.down.compute_dtype == "float16"
