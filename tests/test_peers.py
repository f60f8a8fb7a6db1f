"""The peer projects' own loss-scaling tests, adapted to kmp.LossScaleOptimizer
where kmp claims the same behaviour: Keras 3's loss_scale_optimizer_test.py,
tf-keras 2's mixed_precision/loss_scale_optimizer_test.py and PyTorch's
GradScaler cases (test_torch.py / test_cuda.py). Where kmp differs on
purpose, the test says so and the README's "Where kmp differs" lists it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.training import tf_keras as mixed_precision

# --- Keras 3: keras/src/optimizers/loss_scale_optimizer_test.py (stateful) ---
# Differs on purpose: Keras's tests apply hand-made gradients eagerly, which
# its wrapper takes as scaled; kmp asks eagerly, so they say scaled=True.


def test_keras_config():
    inner = keras.optimizers.SGD(
        learning_rate=0.5, momentum=0.06, nesterov=True, weight_decay=0.004
    )
    optimizer = kmp.LossScaleOptimizer(inner)
    revived = kmp.LossScaleOptimizer.from_config(optimizer.get_config())
    assert revived.get_config() == optimizer.get_config()
    assert revived.inner_optimizer.get_config() == inner.get_config()


def test_keras_infinite_step():
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    grads = [keras.ops.array([np.inf, np.inf, np.inf, np.inf])]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.apply(grads, variables, scaled=True)
    np.testing.assert_allclose(variables[0].numpy(), [1.0, 2.0, 3.0, 4.0])


def test_keras_downscaling():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.5), initial_scale=400.0
    )
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    grads = [keras.ops.array([np.inf, np.inf, np.inf, np.inf])]
    for _ in range(4):
        optimizer.apply(grads, variables, scaled=True)
    assert float(optimizer.scale_loss(1.0)) == 25.0


def test_keras_upscaling():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.5),
        initial_scale=2.0,
        dynamic_growth_steps=2,
    )
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    grads = [keras.ops.array([1.0, 6.0, 7.0, 2.0])]
    for _ in range(8):
        optimizer.apply(grads, variables, scaled=True)
    assert float(optimizer.scale_loss(1.0)) == 32.0


# --- tf-keras 2: tf_keras/mixed_precision/loss_scale_optimizer_test.py -------


def tf_keras_2_optimizer(**kwargs):
    return mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_tf_keras_get_scaled_loss():
    opt = tf_keras_2_optimizer(dynamic=False, initial_scale=2.0)
    loss = tf.convert_to_tensor(5.0)
    assert float(opt.get_scaled_loss(loss)) == 10.0
    assert float(opt.get_scaled_loss(lambda: loss)()) == 10.0
    # Differs on purpose: tf.keras 2 scaled a float16 loss in float16 (which
    # overflows at scales of 2**16 and up); kmp scales it in float32, and
    # says so.
    with pytest.warns(UserWarning, match="kmp scales it rather than refusing"):
        scaled = opt.get_scaled_loss(tf.convert_to_tensor(5.0, dtype="float16"))
    assert scaled.dtype == tf.float32 and float(scaled) == 10.0


def test_tf_keras_get_unscaled_gradients():
    opt = tf_keras_2_optimizer(dynamic=False, initial_scale=2)
    scaled = [
        tf.convert_to_tensor(3.0),
        None,
        tf.convert_to_tensor(-4.0, dtype="float16"),
    ]
    grads = opt.get_unscaled_gradients(scaled)
    assert [None if g is None else float(g) for g in grads] == [1.5, None, -2.0]
    assert grads[2].dtype == tf.float16


def test_tf_keras_get_unscaled_sparse_gradients():
    opt = tf_keras_2_optimizer(dynamic=False, initial_scale=2)
    sparse_scaled = tf.IndexedSlices(
        tf.convert_to_tensor([[4.0, 2.0], [8.0, 5.0]]),
        tf.convert_to_tensor([1, 3], dtype="int32"),
        dense_shape=tf.convert_to_tensor([5, 2], dtype="int32"),
    )
    (sparse,) = opt.get_unscaled_gradients([sparse_scaled])
    assert isinstance(sparse, tf.IndexedSlices)
    np.testing.assert_array_equal(sparse.values.numpy(), [[2.0, 1.0], [4.0, 2.5]])


@pytest.mark.parametrize("use_tf_function", [False, True])
def test_tf_keras_dynamic_loss_scale(use_tf_function):
    var = tf.Variable([5.0])
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(2.0), initial_scale=2, dynamic_growth_steps=1
    )
    assert opt.initial_scale == 2.0 and isinstance(opt.initial_scale, float)
    assert opt.dynamic_growth_steps == 1

    def run():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(var))  # the identity: gradient 1
        return opt.apply(tape.gradient(loss, [var]), [var])

    run = tf.function(run) if use_tf_function else run
    run()
    np.testing.assert_allclose(var.numpy(), [3.0])  # 5 - 1 * 2
    assert float(opt.loss_scale) == 4.0  # doubled after one finite step
    run()
    np.testing.assert_allclose(var.numpy(), [1.0])


def test_tf_keras_dynamic_loss_scale_default_values():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD())
    assert opt.initial_scale == 2**15
    assert opt.dynamic_growth_steps == 2000
    assert float(opt.loss_scale) == 2**15


@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_tf_keras_clipping(clip):
    var = tf.Variable([5.0])
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(2.0, **{clip: 2.0}),
        initial_scale=2,
        dynamic_growth_steps=1,
    )
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(tf.reduce_sum(var * 4))
    opt.apply(tape.gradient(loss, [var]), [var])
    # The gradient is 4, clipped to 2 (unscaled first): 5 - 2 * 2 == 1.
    np.testing.assert_allclose(var.numpy(), [1.0])
    assert float(opt.loss_scale) == 4.0


def test_tf_keras_skipped_steps_do_not_count_as_iterations():
    # Differs on purpose: kmp counts only applied steps in `iterations`, so a
    # learning-rate schedule does not advance on skipped steps.
    var = tf.Variable([1.0])
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    opt.apply([tf.constant([np.inf])], [var], scaled=True)
    opt.apply([tf.constant([1.0]) * 16384.0], [var], scaled=True)  # scale halved: 16384
    assert int(opt.iterations) == 1


# --- PyTorch's GradScaler cases ------------------------------------------------


def test_torch_grad_scaling_update_scale():
    # GradScaler(init_scale=2, growth_factor=2, backoff_factor=0.5,
    # growth_interval=1): a finite step grows, an inf step backs off.
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=2.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        dynamic_growth_steps=1,
    )
    var = keras.Variable([1.0])
    opt.apply([tf.constant([1.0])], [var], scaled=True)
    assert float(opt.loss_scale) == 4.0
    opt.apply([tf.constant([np.inf])], [var], scaled=True)
    assert float(opt.loss_scale) == 2.0


# Differs on purpose: GradScaler refuses a second unscale_() of one
# optimizer's gradients before update(). kmp cannot tell which tensors were
# unscaled without guessing from their identity; instead, each apply() states
# whether its gradients are scaled (`scaled=False` for unscaled ones).


def test_torch_grad_scaling_clipping_sees_unscaled_gradients():
    # Clipping after unscale_ equals clipping in unscaled training.
    def train(scaled):
        w = keras.Variable([3.0, 4.0])
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=1024)
        with kmp.ScaledGradientTape(opt) if scaled else tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        grads = tape.gradient(loss, [w])
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        if scaled:
            opt.apply(grads, [w], scaled=False)
        else:
            opt.inner_optimizer.apply(grads, [w])
        return w.numpy()

    np.testing.assert_allclose(train(True), train(False), rtol=1e-6)


def test_torch_grad_scaling_state_dict_round_trip():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    var = keras.Variable([1.0])
    opt.apply([tf.constant([np.inf])], [var], scaled=True)
    state = {}
    opt.save_own_variables(state)
    other = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    other.build([keras.Variable([1.0])])
    other.load_own_variables(state)
    assert float(other.loss_scale) == 4.0
    assert int(other.skipped_steps_total) == 1


def test_torch_grad_scaling_penalty():
    # A gradient penalty: the inner gradients come from a scaled loss too.
    w = keras.Variable([1.0, 2.0])
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    with kmp.ScaledGradientTape(opt) as outer:
        with tf.GradientTape() as inner:
            y = tf.reduce_sum(w**3)
        grad_y = inner.gradient(y, w)  # 3 w**2
        penalty = tf.reduce_sum(grad_y**2)  # sum 9 w**4
    (grad,) = outer.gradient(penalty, [w])
    np.testing.assert_allclose(grad.numpy(), 36 * w.numpy() ** 3, rtol=1e-5)


def test_torch_grad_scaling_accumulation():
    # Two micro-batches per step: the same update as one batch of both.
    def train(steps):
        w = keras.Variable([1.0, -1.0])
        accumulate = {"gradient_accumulation_steps": steps} if steps > 1 else {}
        inner = keras.optimizers.SGD(0.5, **accumulate)
        opt = kmp.LossScaleOptimizer(inner, initial_scale=256.0)
        for x in ([1.0, 2.0], [3.0, 4.0]) if steps == 2 else ([2.0, 3.0],):
            with kmp.ScaledGradientTape(opt) as tape:
                loss = tf.reduce_sum(w * tf.constant(x))
            opt.apply(tape.gradient(loss, [w]), [w], scaled=False)
        return w.numpy()

    np.testing.assert_allclose(train(2), train(1), rtol=1e-6)
