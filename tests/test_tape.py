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
        return opt.apply(grads, model.trainable_variables, scaled=False)

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
    model, opt = setup_model(initial_scale=256, dynamic_growth_steps=1)
    x, y = data()
    opt.build(model.trainable_variables)  # variables are not created in the step
    traces = []

    @tf.function
    def step(x):
        traces.append(1)
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_fn(model, x, y)
        return opt.apply(
            tape.gradient(loss, model.trainable_variables),
            model.trainable_variables,
            scaled=False,
        )

    bad = x.copy()
    bad[0, 0] = np.inf
    for batch in (x, x, bad, x):
        step(batch)
    assert len(traces) == 1
    # dynamic_growth_steps=1: 256 -> 512 -> 1024 -> (overflow) 512 -> 1024
    assert float(opt.loss_scale) == 1024.0
    assert int(opt.skipped_steps_total) == 1


def plain_gradients(model, x, y, scale=1.0):
    with tf.GradientTape() as plain:
        reference = loss_fn(model, x, y) * scale
    return plain.gradient(reference, model.trainable_variables)


def test_persistent_tape_gives_unscaled_gradients_twice():
    model, opt = setup_model(initial_scale=512)
    x, y = data()
    with kmp.ScaledGradientTape(opt, persistent=True) as tape:
        loss = loss_fn(model, x, y)
        other = 2.0 * loss
    first = tape.gradient(loss, model.trainable_variables)
    second = tape.gradient(other, model.trainable_variables)
    del tape
    expected = plain_gradients(model, x, y)
    for a, b, e in zip(first, second, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=2e-2, atol=1e-4)
        np.testing.assert_allclose(b, 2.0 * e.numpy(), rtol=2e-2, atol=2e-4)


def test_gradients_from_a_tf_function_applied_eagerly_are_unscaled_once():
    """Gradients a tf.function's tape handed out, applied eagerly as stated."""
    kmp.set_policy("mixed_float16")
    w = keras.Variable(np.zeros(2, "float32"))
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), mode="static", initial_scale=1024
    )

    @tf.function
    def gradients():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = tf.reduce_sum(w * tf.constant([1.0, 2.0]))
        return tape.gradient(loss, [w])

    for step in range(3):
        before = w.numpy().copy()
        assert bool(opt.apply(gradients(), [w], scaled=False))
        np.testing.assert_allclose(before - w.numpy(), [1.0, 2.0], err_msg=str(step))


def test_float16_variables_are_unscaled_in_float32():
    """Pure float16: dividing by a scale of 2**16 (inf in float16) still works."""
    kmp.set_policy("float16")
    w = keras.Variable(np.ones(3, "float16"), dtype="float16")
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0),
        mode="static",
        initial_scale=2.0**16,
        max_scale=2.0**16,
    )
    scaled = tf.constant([1024.0, 2048.0, 4096.0], tf.float16)  # 2**16 x [1/64, ...]
    assert bool(opt.apply([scaled], [w], scaled=True))
    np.testing.assert_array_equal(
        w.numpy(), np.array([1 - 1 / 64, 1 - 1 / 32, 1 - 1 / 16], "float16")
    )


def test_a_sixteen_bit_loss_is_scaled_in_float32_with_a_warning():
    opt = kmp.LossScaleOptimizer("sgd", mode="dynamic", initial_scale=2.0**20)
    with pytest.warns(UserWarning, match="kmp scales it rather") as caught:
        scaled = opt.scale_loss(tf.constant(1.0, tf.float16))
        opt.scale_loss(tf.constant(2.0, tf.bfloat16))
    # 2**20 overflows float16: the scaled loss is float32, and said once.
    assert scaled.dtype == tf.float32 and float(scaled) == 2.0**20
    assert len([w for w in caught if "kmp scales it" in str(w.message)]) == 1
    assert caught[0].filename == __file__  # the caller's line


@pytest.mark.parametrize(
    "scale, applied", [(2.0**10, True), (2.0**16, False)], ids=["2**10", "2**16"]
)
def test_a_float16_losss_gradients_start_in_float16(scale, applied):
    # The backward pass of a float16 loss starts with the scale in float16:
    # at 2**16 it overflows, the step is skipped and the scale lowered, as
    # the warning says; below, the update is exact.
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), mode="dynamic", initial_scale=scale
    )
    w = keras.Variable(1.0)
    with tf.GradientTape() as tape, pytest.warns(UserWarning, match=r"2\*\*16"):
        loss = tf.cast(3.0 * w.value, "float16")
        scaled = opt.scale_loss(loss)
    opt.apply(tape.gradient(scaled, [w.value]), [w])
    assert float(w.numpy()) == (1.0 - 0.5 * 3.0 if applied else 1.0)
    assert float(opt.loss_scale) == (scale if applied else scale / 2)


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


def test_get_unscaled_gradients_applied_as_stated_unscaled():
    # tf.keras 2's calls, on the class that has them.
    model, _ = setup_model()
    opt = kmp.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=1024
    )
    x, y = data()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
            scaled_loss = opt.get_scaled_loss(loss)
        scaled = tape.gradient(scaled_loss, model.trainable_variables)
        grads = opt.get_unscaled_gradients(scaled)
        opt.apply_gradients(
            zip(grads, model.trainable_variables, strict=True), scaled=False
        )
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


def test_tape_with_mode_none_is_a_plain_tape():
    model, opt = setup_model("mixed_bfloat16", mode="none")
    x, y = data()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_fn(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    for g, e in zip(grads, plain_gradients(model, x, y), strict=True):
        np.testing.assert_array_equal(g, e)
    assert bool(opt.apply(grads, model.trainable_variables, scaled=False))
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
