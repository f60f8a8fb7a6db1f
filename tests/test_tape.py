import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp


def setup_model(policy="mixed_float16", **opt_kwargs):
    kmp.set_policy(policy)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **opt_kwargs)
    return model, opt


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True) * 0.1


def loss_fn(model, x, y):
    return tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y))


def test_gradients_are_unscaled_and_match_a_plain_tape():
    model, opt = setup_model(initial_scale=1024)
    x, y = data()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_fn(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as plain:
        reference = loss_fn(model, x, y)
    expected = plain.gradient(reference, model.trainable_variables)
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_training_step_applies_finite_and_skips_overflowing_gradients(compiled):
    model, opt = setup_model(initial_scale=256)
    x, y = data()

    def step(x, y):
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_fn(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        return opt.apply(grads, model.trainable_variables)

    if compiled:
        step = tf.function(step)
    assert bool(step(x, y))
    before = [w.numpy() for w in model.weights]
    bad = x.copy()
    bad[0, 0] = np.inf
    assert not bool(step(bad, y))
    for b, w in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(b, w.numpy())
    assert float(opt.loss_scale) == 128.0
    assert bool(step(x, y))


def test_scale_changes_do_not_retrace_the_step():
    model, opt = setup_model(initial_scale=256, growth_interval=1)
    x, y = data()
    opt.build(model.trainable_variables)  # variables are not created in the step
    traces = []

    @tf.function
    def step(x):
        traces.append(1)
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_fn(model, x, y)
        return opt.apply(
            tape.gradient(loss, model.trainable_variables), model.trainable_variables
        )

    bad = x.copy()
    bad[0, 0] = np.inf
    for batch in (x, x, bad, x):
        step(batch)
    assert len(traces) == 1
    # growth_interval=1: 256 -> 512 -> 1024 -> (overflow) 512 -> 1024
    assert float(opt.loss_scale) == 1024.0
    assert int(opt.skipped_steps_total) == 1


def test_persistent_tape_gives_unscaled_gradients_twice():
    model, opt = setup_model(initial_scale=512)
    x, y = data()
    with kmp.ScaledGradientTape(opt, persistent=True) as tape:
        loss = loss_fn(model, x, y)
        other = 2.0 * loss
    first = tape.gradient(loss, model.trainable_variables)
    second = tape.gradient(other, model.trainable_variables)
    del tape
    for a, b in zip(first, second, strict=True):
        np.testing.assert_allclose(2.0 * a.numpy(), b.numpy(), rtol=1e-6)


def test_gradient_penalty_gradient_of_a_gradient():
    model, opt = setup_model(initial_scale=512)
    x, y = data()
    x = tf.constant(x)

    def penalised(tape_cls_outer):
        with tape_cls_outer() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                out = tf.cast(model(x), tf.float32)
            dx = inner.gradient(out, x)
            loss = tf.reduce_mean(tf.square(dx)) + loss_fn(model, x, y)
        return outer.gradient(loss, model.trainable_variables)

    scaled = penalised(lambda: kmp.ScaledGradientTape(opt))
    plain = penalised(tf.GradientTape)
    for a, b in zip(scaled, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=1e-3)


def test_tf_keras_2_style_scaled_loss_and_unscaled_gradients():
    model, opt = setup_model(initial_scale=1024)
    x, y = data()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
            scaled_loss = opt.get_scaled_loss(loss)
        scaled = tape.gradient(scaled_loss, model.trainable_variables)
        grads = opt.get_unscaled_gradients(scaled)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return grads

    with tf.GradientTape() as plain:
        reference = loss_fn(model, x, y)
    expected = plain.gradient(reference, model.trainable_variables)
    before = [w.numpy() for w in model.trainable_variables]
    grads = step()
    for g, e, b, w in zip(
        grads, expected, before, model.trainable_variables, strict=True
    ):
        np.testing.assert_allclose(g, e, rtol=2e-2, atol=1e-4)
        # SGD(0.1) applied the unscaled gradient once, not divided again.
        np.testing.assert_allclose(b - w.numpy(), 0.1 * e.numpy(), rtol=3e-2, atol=1e-5)


def test_tape_under_bfloat16_is_a_plain_tape():
    model, opt = setup_model("mixed_bfloat16")
    x, y = data()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_fn(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    assert bool(opt.apply(grads, model.trainable_variables))
    assert float(opt.loss_scale) == 1.0


def test_tape_requires_a_kmp_optimizer_and_a_float_loss():
    with pytest.raises(TypeError, match=r"kmp\.LossScaleOptimizer"):
        kmp.ScaledGradientTape(keras.optimizers.SGD())
    opt = kmp.LossScaleOptimizer("sgd", mode="dynamic")
    v = tf.Variable(3)
    with kmp.ScaledGradientTape(opt) as tape:
        loss = v * 2
    with pytest.raises(TypeError, match="floating-point"):
        tape.gradient(loss, [v])
