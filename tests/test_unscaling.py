"""Whether apply() unscales: decided from where the gradients came from
(kmp.unscaling), for every call sequence; inconsistent ones are refused."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

SCALE = 1024.0


def setup(lr=1.0):
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(lr), initial_scale=SCALE)
    w = keras.Variable([3.0, 4.0])
    opt.build([w])
    return opt, w


def loss_of(w):
    return tf.reduce_sum(w * w) / 2.0  # gradient: w


def step_size(w, before):
    return before - w.numpy()


def test_keras3_sequence_scale_loss_plain_tape_apply_unscales():
    opt, w = setup()
    before = w.numpy().copy()
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(loss_of(w))
    opt.apply(tape.gradient(loss, [w]), [w])
    np.testing.assert_allclose(step_size(w, before), before, rtol=1e-6)


def test_a_persistent_tape_two_gradients_two_applies_unscale_once_each():
    opt, w = setup(lr=0.5)
    with kmp.ScaledGradientTape(opt, persistent=True) as tape:
        loss = loss_of(w)
    first = tape.gradient(loss, [w])
    second = tape.gradient(loss, [w])
    before = w.numpy().copy()
    opt.apply(first, [w])
    opt.apply(second, [w])
    # Each update is lr * w_before (the gradients were taken before either
    # apply): 0.5 * w twice, none divided by the scale again.
    np.testing.assert_allclose(step_size(w, before), before, rtol=1e-6)


def test_unscaled_copies_for_logging_then_applying_the_scaled_gradients():
    opt, w = setup()
    before = w.numpy().copy()
    with tf.GradientTape() as tape:
        loss = opt.get_scaled_loss(loss_of(w))
    scaled = tape.gradient(loss, [w])
    unscaled = opt.get_unscaled_gradients(scaled)
    np.testing.assert_allclose(tf.linalg.global_norm(unscaled), 5.0, rtol=1e-6)
    opt.apply(scaled, [w])  # Keras 3 semantics: apply unscales these
    np.testing.assert_allclose(step_size(w, before), before, rtol=1e-6)


def test_tf_keras_2_sequence_with_clipping_applies_unscaled_gradients_once():
    opt, w = setup(lr=0.1)
    before = w.numpy().copy()
    with tf.GradientTape() as tape:
        loss = opt.get_scaled_loss(loss_of(w))
    grads = opt.get_unscaled_gradients(tape.gradient(loss, [w]))
    grads, _ = tf.clip_by_global_norm(grads, 10.0)  # new tensors: derived
    opt.apply_gradients(zip(grads, [w], strict=True))
    np.testing.assert_allclose(step_size(w, before), 0.1 * before, rtol=1e-6)


def test_scaling_a_loss_inside_a_scaled_gradient_tape_is_refused():
    opt, w = setup()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
        with pytest.raises(kmp.LossScaleError, match="scaled twice"):
            opt.get_scaled_loss(loss)
    tape.gradient(loss, [w])  # the tape itself still works


def test_unscaling_gradients_twice_is_refused():
    opt, w = setup()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    grads = tape.gradient(loss, [w])
    with pytest.raises(kmp.LossScaleError, match="unscaled already"):
        opt.get_unscaled_gradients(grads)


def test_a_mix_of_unscaled_and_other_gradients_is_refused():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=SCALE)
    a, b = keras.Variable(1.0), keras.Variable(2.0)
    opt.build([a, b])
    with kmp.ScaledGradientTape(opt) as tape:
        loss = a * a
    (ga,) = tape.gradient(loss, [a])
    with pytest.raises(kmp.LossScaleError, match="a mix of gradients"):
        opt.apply([ga, tf.constant(1.0)], [a, b])


def test_scale_loss_takes_a_python_number_and_a_callable():
    opt, _ = setup()
    assert float(opt.scale_loss(1.0)) == SCALE  # as Keras's own wrapper
    assert float(opt.get_scaled_loss(lambda: tf.constant(2.0))) == 2 * SCALE


def test_gradients_from_a_tf_function_applied_eagerly_follow_the_run_time_state():
    opt, w = setup(lr=0.5)

    @tf.function
    def tape_gradients():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_of(w)
        return tape.gradient(loss, [w])

    @tf.function
    def scaled_gradients():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_of(w))
        return tape.gradient(loss, [w])

    for make in (tape_gradients, scaled_gradients):
        w.assign([3.0, 4.0])
        before = w.numpy().copy()
        grads = make()  # eager values: no identity to read
        opt.apply(grads, [w])
        np.testing.assert_allclose(step_size(w, before), 0.5 * before, rtol=1e-6)


def test_gradients_passed_into_a_tf_function_follow_the_run_time_state():
    opt, w = setup(lr=0.5)
    apply = tf.function(lambda g: opt.apply(g, [w]))
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    grads = tape.gradient(loss, [w])
    before = w.numpy().copy()
    apply(grads)
    np.testing.assert_allclose(step_size(w, before), 0.5 * before, rtol=1e-6)
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(loss_of(w))
    grads = tape.gradient(loss, [w])
    before = w.numpy().copy()
    apply(grads)
    np.testing.assert_allclose(step_size(w, before), 0.5 * before, rtol=1e-6)


def test_keras_own_tests_apply_pre_scaled_gradients_directly():
    # keras/src/optimizers/loss_scale_optimizer_test.py, test_finite_step.
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    grads = [keras.ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.apply(grads, variables)
    np.testing.assert_allclose(
        variables[0].numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4
    )


class UnscaledStep(keras.Model):
    """keras-io "Customizing what happens in fit()": gradients of the
    unscaled loss, then self.optimizer.apply."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


def test_a_custom_train_step_that_never_scales_gets_right_sized_updates():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    model = UnscaledStep(inputs, keras.layers.Dense(1)(hidden(inputs)))
    kmp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert model.optimizer.mode == "dynamic"
    before = hidden.kernel.numpy().copy()
    with pytest.warns(UserWarning, match=r"loss = self.optimizer.scale_loss\(loss\)"):
        model.fit(np.ones((4, 1)), np.full((4, 1), 3.0), batch_size=4, verbose=0)
    moved = float(np.abs(hidden.kernel.numpy() - before).max())
    assert moved > 1e-2  # divided by 32768 it would be about 1e-6
    model.train_function = None  # traced again: the step decides again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        model.fit(np.ones((4, 1)), np.full((4, 1), 3.0), batch_size=4, verbose=0)
    assert float(np.abs(hidden.kernel.numpy() - before).max()) > moved


def test_a_custom_train_step_run_eagerly_is_never_silently_mis_scaled():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    model = UnscaledStep(inputs, keras.layers.Dense(1)(hidden(inputs)))
    kmp.compile(
        model, optimizer=keras.optimizers.SGD(0.1), loss="mse", run_eagerly=True
    )
    with pytest.warns(UserWarning, match=r"cannot tell whether they are scaled"):
        model.fit(np.ones((4, 1)), np.full((4, 1), 3.0), batch_size=4, verbose=0)


def test_a_loss_scaled_inside_a_loop_body_is_unscaled_once_outside_it():
    # Manual micro-batch accumulation: scale_loss inside tf.range's body,
    # one apply after the loop.
    opt, w = setup(lr=0.5)
    before = w.numpy().copy()

    @tf.function
    def step():
        total = [tf.zeros_like(w)]
        for _ in tf.range(2):
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(loss_of(w))
            total = [total[0] + tape.gradient(loss, [w])[0]]
        opt.apply([total[0] / 2.0], [w])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loss was scaled: no warning
        step()
    np.testing.assert_allclose(step_size(w, before), 0.5 * before, rtol=1e-6)


def test_a_hand_out_never_applied_does_not_decide_a_later_step():
    opt, w = setup(lr=0.5)
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    tape.gradient(loss, [w])  # only to log a norm; never applied
    before = w.numpy().copy()
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(loss_of(w))
    opt.apply(tape.gradient(loss, [w]), [w])
    np.testing.assert_allclose(step_size(w, before), 0.5 * before, rtol=1e-6)


def test_a_persistent_tape_three_gradients_three_applies_unscale_once_each():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=SCALE)
    ws = [keras.Variable([2.0]) for _ in range(3)]
    opt.build(ws)
    with kmp.ScaledGradientTape(opt, persistent=True) as tape:
        losses = [loss_of(w) for w in ws]
    grads = [tape.gradient(loss, [w]) for loss, w in zip(losses, ws, strict=True)]
    for g, w in zip(grads, ws, strict=True):
        opt.apply(g, [w])
    np.testing.assert_allclose([float(w.numpy()[0]) for w in ws], [0.0] * 3, atol=1e-6)


def test_logging_unscaled_copies_of_a_float8_model_then_applying_the_scaled_ones():
    # Unscaling leaves float8 scale entries as they are: the same tensors
    # in both lists mark nothing, and apply unscales the rest once.
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.quantize("float8")
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=SCALE)
    opt.build(model.trainable_variables)
    x = tf.ones((2, 4))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(
                tf.reduce_sum(tf.cast(model(x, training=True), "float32"))
            )
        grads = tape.gradient(loss, model.trainable_variables)
        norm = tf.linalg.global_norm(
            [g for g in opt.get_unscaled_gradients(grads, model.trainable_variables)]
        )
        opt.apply(grads, model.trainable_variables)
        return norm

    assert np.isfinite(float(step()))
    kernel = model.layers[0].kernel
    assert float(tf.reduce_max(tf.abs(kernel))) < 10.0  # not 1024x too large


def test_unscaling_twice_under_mode_none_changes_nothing_and_is_allowed():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), mode="none")
    w = keras.Variable([3.0, 4.0])
    opt.build([w])
    g = [tf.constant([3.0, 4.0])]
    once = opt.get_unscaled_gradients(g)
    twice = opt.get_unscaled_gradients(once)
    opt.apply(twice, [w])
    np.testing.assert_allclose(w.numpy(), [1.5, 2.0])


def test_the_tf_keras_2_sequence_leaves_no_records_behind():
    opt, w = setup(lr=0.01)
    for _ in range(5):
        with tf.GradientTape() as tape:
            loss = opt.get_scaled_loss(loss_of(w))
        grads = opt.get_unscaled_gradients(tape.gradient(loss, [w]))
        opt.apply_gradients(zip(grads, [w], strict=True))
    context = opt._ledger._context()
    assert context.hand_outs == [] and context.scaled_losses == []
