"""Whether apply() unscales: each entry point's contract (kmp.unscaling),
checked by the size of the update it applies, eagerly and traced; the
sequences a contract makes wrong are refused with the call to use."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.backend import backward
from kmp.training import tf_keras as mixed_precision

SCALE = 1024.0
LR = 0.5


def setup(lr=LR, cls=kmp.LossScaleOptimizer):
    opt = cls(keras.optimizers.SGD(lr), initial_scale=SCALE)
    w = keras.Variable([3.0, 4.0])
    opt.build([w])
    return opt, w


def loss_of(w):
    return tf.reduce_sum(w * w) / 2.0  # gradient: w


def ratio(w, before, lr=LR):
    """The applied update over the correct one (lr * gradient, gradient w)."""
    return (before - w.numpy()) / (lr * before)


def maybe_traced(traced):
    return tf.function if traced else (lambda f: f)


def assert_right_size(w, before, lr=LR):
    np.testing.assert_allclose(ratio(w, before, lr), 1.0, rtol=1e-6)


# --- Keras 3's contract: apply takes the gradients of scale_loss(loss) -------


@pytest.mark.parametrize("traced", [False, True])
def test_gradients_of_scale_loss_are_unscaled_once(traced):
    opt, w = setup()
    before = w.numpy().copy()

    @maybe_traced(traced)
    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_of(w))
        opt.apply(tape.gradient(loss, [w]), [w])

    step()
    assert_right_size(w, before)


def test_an_eager_tape_taken_to_log_a_norm_does_not_change_a_traced_step():
    # An eager ScaledGradientTape.gradient(), only to log a gradient norm,
    # then a tf.function that applies the gradients of scale_loss(loss).
    opt, w = setup()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    norm = tf.linalg.global_norm(tape.gradient(loss, [w]))
    np.testing.assert_allclose(float(norm), 5.0, rtol=1e-6)
    before = w.numpy().copy()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_of(w))
        opt.apply(tape.gradient(loss, [w]), [w])

    step()
    assert_right_size(w, before)  # was 1024x too large


def test_an_eager_tape_taken_to_log_a_norm_then_scaled_gradients_applied_eagerly():
    # The same, with the gradients of scale_loss(loss) returned by a
    # tf.function and applied eagerly: eagerly, kmp cannot see where they
    # came from, and a tape handed out gradients since the last apply, so it
    # asks instead of guessing (it applied 1024x the update before).
    opt, w = setup()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    tf.linalg.global_norm(tape.gradient(loss, [w]))

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_of(w))
        return tape.gradient(loss, [w])

    before = w.numpy().copy()
    with pytest.raises(kmp.LossScaleError, match=r"scaled=True"):
        opt.apply(gradients(), [w])
    np.testing.assert_array_equal(w.numpy(), before)
    opt.apply(gradients(), [w], scaled=True)
    assert_right_size(w, before)


def test_scaled_gradients_from_a_function_traced_before_are_unscaled():
    # A tf.function computing the gradients of scale_loss(loss), called once
    # eagerly (a warm-up), then called inside another tf.function that
    # applies them: its cached trace leaves no record in the outer one, but
    # its gradients read the loss scale there (an input of the call).
    opt, w = setup()

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_of(w))
        return tape.gradient(loss, [w])

    gradients()  # warm-up: traced here, not in `step`
    before = w.numpy().copy()

    @tf.function
    def step():
        opt.apply(gradients(), [w])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never scaled" warning
        step()
    assert_right_size(w, before)  # was 1024x too large


def test_gradients_passed_into_a_function_follow_the_contract():
    # Keras's own tests apply pre-scaled gradients; as tf.function arguments
    # they are values from outside the trace: the contract, unscaled.
    opt, w = setup()
    before = w.numpy().copy()
    scaled = [tf.constant(before * SCALE)]
    tf.function(lambda g: opt.apply(g, [w]))(scaled)
    assert_right_size(w, before)


def test_keras_own_tests_apply_pre_scaled_gradients_directly():
    # keras/src/optimizers/loss_scale_optimizer_test.py, test_finite_step.
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    grads = [keras.ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.apply(grads, variables, scaled=True)
    np.testing.assert_allclose(
        variables[0].numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4
    )


def test_a_loss_scaled_inside_a_loop_body_is_unscaled_once_outside_it():
    # Manual micro-batch accumulation: scale_loss inside tf.range's body,
    # one apply after the loop.
    opt, w = setup()
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
    assert_right_size(w, before)


# --- unscaled gradients are applied with scaled=False -------------------------


@pytest.mark.parametrize("traced", [False, True])
def test_tape_gradients_applied_as_stated_unscaled(traced):
    opt, w = setup()
    before = w.numpy().copy()

    @maybe_traced(traced)
    def step():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_of(w)
        grads, _ = tf.clip_by_global_norm(tape.gradient(loss, [w]), 100.0)
        opt.apply(grads, [w], scaled=False)

    step()
    assert_right_size(w, before)


@pytest.mark.parametrize("traced", [False, True])
def test_tape_gradients_applied_without_saying_so_are_refused(traced):
    opt, w = setup()
    before = w.numpy().copy()

    @maybe_traced(traced)
    def step():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_of(w)
        opt.apply(tape.gradient(loss, [w]), [w])

    with pytest.raises(kmp.LossScaleError, match=r"scaled=False"):
        step()
    np.testing.assert_array_equal(w.numpy(), before)  # nothing applied


def test_unscaled_gradients_then_apply_without_saying_so_is_refused():
    # tf.keras 2's spellings live on its own class only; unscaled gradients
    # handed to the Keras-3-contract optimizer unstated are refused, with
    # both fixes named; stated, it applies the right update.
    assert not hasattr(kmp.LossScaleOptimizer, "get_unscaled_gradients")
    opt, w = setup()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    grads = tape.gradient(loss, [w])
    with pytest.raises(kmp.LossScaleError, match=r"scaled=False"):
        opt.apply_gradients(zip(grads, [w], strict=True))
    before = w.numpy().copy()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    grads = tape.gradient(loss, [w])
    opt.apply_gradients(zip(grads, [w], strict=True), scaled=False)
    assert_right_size(w, before)


def test_unscaled_copies_taken_to_log_then_the_scaled_gradients_stated():
    opt, w = setup(cls=mixed_precision.LossScaleOptimizer)
    before = w.numpy().copy()
    with tf.GradientTape() as tape:
        loss = opt.get_scaled_loss(loss_of(w))
    scaled = tape.gradient(loss, [w])
    unscaled = opt.get_unscaled_gradients(scaled)
    np.testing.assert_allclose(tf.linalg.global_norm(unscaled), 5.0, rtol=1e-6)
    opt.apply(scaled, [w], scaled=True)
    assert_right_size(w, before)


def test_a_persistent_tape_two_gradients_two_applies():
    opt, w = setup()
    with kmp.ScaledGradientTape(opt, persistent=True) as tape:
        loss = loss_of(w)
    first = tape.gradient(loss, [w])
    second = tape.gradient(loss, [w])
    before = w.numpy().copy()
    opt.apply(first, [w], scaled=False)
    opt.apply(second, [w], scaled=False)
    # Both gradients were taken before either update: lr * w twice.
    np.testing.assert_allclose(ratio(w, before), 2.0, rtol=1e-6)


def test_tape_gradients_from_a_function_traced_before_applied_as_stated():
    opt, w = setup()

    @tf.function
    def gradients():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_of(w)
        return tape.gradient(loss, [w])

    gradients()
    for _ in range(2):
        before = w.numpy().copy()
        tf.function(lambda: opt.apply(gradients(), [w], scaled=False))()
        assert_right_size(w, before)


def test_two_optimizers_keep_their_own_records():
    # A GAN's two optimizers: one's tape hands out, the other's apply takes
    # scaled gradients as its contract says.
    d_opt, d = setup()
    g_opt, g = setup()
    before = g.numpy().copy()

    @tf.function
    def step():
        with kmp.ScaledGradientTape(d_opt) as tape:
            loss = loss_of(d)
        d_opt.apply(tape.gradient(loss, [d]), [d], scaled=False)
        with tf.GradientTape() as tape:
            loss = g_opt.scale_loss(loss_of(g))
        g_opt.apply(tape.gradient(loss, [g]), [g])

    step()
    assert_right_size(g, before)


def test_records_start_afresh_after_each_apply_in_a_trace():
    # A tape's step, then a Keras 3 step, in one traced function: the first
    # apply's hand-out says nothing about the second.
    opt, w = setup()
    before = w.numpy().copy()

    @tf.function
    def two_steps():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_of(w)
        opt.apply(tape.gradient(loss, [w]), [w], scaled=False)
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_of(w))
        opt.apply(tape.gradient(loss, [w]), [w])

    two_steps()
    # w -> w (1 - lr) twice: 3 * 0.25, 4 * 0.25.
    np.testing.assert_allclose(w.numpy(), before * (1 - LR) ** 2, rtol=1e-6)


def test_scaled_must_be_a_bool():
    opt, w = setup()
    with pytest.raises(TypeError, match="scaled must be True, False or None"):
        opt.apply([tf.constant([1.0, 1.0])], [w], scaled="no")


# --- tf.keras 2's contract: kmp.mixed_precision.LossScaleOptimizer ------------


@pytest.mark.parametrize("traced", [False, True])
def test_tf_keras_2_sequence_with_clipping_applies_unscaled_gradients(traced):
    opt, w = setup(cls=mixed_precision.LossScaleOptimizer)
    before = w.numpy().copy()

    @maybe_traced(traced)
    def step():
        with tf.GradientTape() as tape:
            scaled_loss = opt.get_scaled_loss(lambda: loss_of(w))()
        grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, [w]))
        grads, _ = tf.clip_by_global_norm(grads, 100.0)
        opt.apply_gradients(zip(grads, [w], strict=True))

    step()
    assert_right_size(w, before)


def test_tf_keras_2_apply_gradients_refuses_gradients_left_scaled():
    opt, w = setup(cls=mixed_precision.LossScaleOptimizer)
    before = w.numpy().copy()
    with tf.GradientTape() as tape:
        scaled_loss = opt.get_scaled_loss(loss_of(w))
    scaled = tape.gradient(scaled_loss, [w])
    with pytest.raises(kmp.LossScaleError, match="get_unscaled_gradients"):
        opt.apply_gradients(zip(scaled, [w], strict=True))
    np.testing.assert_array_equal(w.numpy(), before)


def test_get_scaled_loss_of_a_callable_returns_a_callable():
    opt, _ = setup(cls=mixed_precision.LossScaleOptimizer)
    scaled = opt.get_scaled_loss(lambda: tf.constant(2.0))
    assert callable(scaled)
    assert float(scaled()) == 2 * SCALE
    assert float(opt.get_scaled_loss(tf.constant(2.0))) == 2 * SCALE


def test_scale_loss_takes_a_python_number():
    opt, _ = setup()
    assert float(opt.scale_loss(1.0)) == SCALE  # as Keras's own wrapper


# --- refusals, and what is not kept ------------------------------------------


def test_scaling_a_loss_inside_a_scaled_gradient_tape_is_refused():
    opt, w = setup()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
        with pytest.raises(kmp.LossScaleError, match="scaled twice"):
            opt.scale_loss(loss)
    tape.gradient(loss, [w])  # the tape itself still works


def test_without_loss_scaling_nothing_is_refused():
    # Mode 'none': scaled and unscaled gradients are the same update.
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(LR), mode="none")
    w = keras.Variable([3.0, 4.0])
    opt.build([w])
    before = w.numpy().copy()
    with kmp.ScaledGradientTape(opt) as tape:
        loss = loss_of(w)
    opt.apply(tape.gradient(loss, [w]), [w])
    assert_right_size(w, before)


def test_the_decision_keeps_no_variable_and_no_state_between_contexts():
    # No control value is saved or shared (a checkpoint holds only state).
    opt, w = setup()
    names = [v.name for v in opt.variables]
    assert not [n for n in names if "pending" in n], names
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(loss_of(w))
    opt.apply(tape.gradient(loss, [w]), [w])
    context = opt._ledger._context()
    assert (context.scaled_losses, context.hand_outs) == (0, 0)  # since apply


def test_logging_unscaled_copies_of_a_float8_model_then_applying_the_scaled_ones():
    # Unscaling leaves float8 scale entries as they are; stated scaled, apply
    # unscales the rest once.
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.quantize("float8")
    opt = mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=SCALE
    )
    opt.build(model.trainable_variables)
    x = tf.ones((2, 4))
    kernel = model.layers[0].kernel
    before = kernel.numpy().copy()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = opt.get_scaled_loss(
                tf.reduce_sum(tf.cast(model(x, training=True), "float32"))
            )
        grads = tape.gradient(loss, model.trainable_variables)
        norm = tf.linalg.global_norm(
            [g for g in opt.get_unscaled_gradients(grads, model.trainable_variables)]
        )
        opt.apply(grads, model.trainable_variables, scaled=True)
        return norm

    assert np.isfinite(float(step()))
    # d(sum(x @ K))/dK is 2 everywhere (two rows of ones): 0.01 * 2, once.
    np.testing.assert_allclose(before - kernel.numpy(), 0.02, rtol=2e-2)


# --- a custom train_step that never scales ------------------------------------


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


def linear_model(cls, policy):
    """Two Dense layers (the output one stays float32 under kmp's rules)."""
    kmp.set_policy(policy)
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)(hidden)
    return cls(inputs, outputs)


def test_a_traced_custom_train_step_that_never_scales_gets_right_sized_updates():
    x, y = np.ones((4, 1), "float32"), np.full((4, 1), 3.0, "float32")
    reference = linear_model(UnscaledStep, "float32")
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x, y, batch_size=4, verbose=0)
    model = linear_model(UnscaledStep, "mixed_float16")
    kmp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert model.optimizer.mode == "dynamic"
    with pytest.warns(UserWarning, match=r"scale_loss\(loss\)") as caught:
        model.fit(x, y, batch_size=4, verbose=0)
    # The warning names the user's line: the train_step's apply.
    assert [w.filename for w in caught if "never scaled" in str(w.message)] == [
        __file__
    ]
    # d/dk (k * k - 3)^2 = -8 at k = 1: 1 + 0.1 * 8 = 1.8 (not 1 + 2.4e-5).
    np.testing.assert_allclose(model.get_weights(), reference.get_weights(), rtol=1e-3)
    model.train_function = None  # traced again: the step decides again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        model.fit(x, y, batch_size=4, verbose=0)
    reference.fit(x, y, batch_size=4, verbose=0)
    np.testing.assert_allclose(model.get_weights(), reference.get_weights(), rtol=1e-3)


def _loop_that_never_scales():
    """A custom loop in a `tf.function` (autograph converts it) that applies
    the gradients of a loss it never scaled; returns the line of its apply
    and the function."""
    opt, w = setup()

    @tf.function
    def step():
        for _ in tf.range(1):  # a loop's body, as most loops apply in
            with tf.GradientTape() as tape:
                loss = loss_of(w)
            opt.apply(tape.gradient(loss, [w]), [w])

    import inspect

    lines, first = inspect.getsourcelines(step)
    line = first + next(i for i, text in enumerate(lines) if "opt.apply" in text)
    return step, line


def test_a_warning_in_a_tf_function_loop_names_the_users_line():
    # Not autograph's converted copy in a temporary file.
    step, apply_line = _loop_that_never_scales()
    with pytest.warns(UserWarning, match="never scaled") as caught:
        step()
    (warning,) = [w for w in caught if "never scaled" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, apply_line)


def test_without_autographs_source_map_a_warning_names_the_users_call(monkeypatch):
    # Where TensorFlow no longer keeps what kmp reads, the warning still
    # names the user's file: the line that calls their tf.function.
    import inspect

    from kmp.internals import autograph

    monkeypatch.setattr(autograph, "origin", lambda frame: None)
    step, _ = _loop_that_never_scales()
    with pytest.warns(UserWarning, match="never scaled") as caught:
        call_line = inspect.currentframe().f_lineno + 1
        step()
    (warning,) = [w for w in caught if "never scaled" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, call_line)


def test_a_custom_train_step_run_eagerly_that_never_scales_is_refused():
    # Eagerly there is no trace to read: kmp cannot tell these gradients from
    # those of a scaled loss (Keras's own wrapper divides them by the scale),
    # so it asks, with the line to add, and changes nothing.
    model = linear_model(UnscaledStep, "mixed_float16")
    kmp.compile(
        model, optimizer=keras.optimizers.SGD(0.1), loss="mse", run_eagerly=True
    )
    before = model.get_weights()
    with pytest.raises(kmp.LossScaleError, match=r"optimizer\.scale_loss\(loss\)"):
        model.fit(np.ones((4, 1)), np.full((4, 1), 3.0), batch_size=4, verbose=0)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_gradients_read_from_a_variable_or_changed_arguments_follow_the_contract():
    # Gradients of scale_loss accumulated into a variable by one function
    # and applied by another, and scaled gradients passed in and changed
    # there: no backward pass of the applying trace made them, so they are
    # not taken for never scaled (they were applied 1024x too large).
    opt, w = setup()
    acc = tf.Variable(tf.zeros_like(w))

    @tf.function
    def accumulate():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_of(w))
        acc.assign_add(tape.gradient(loss, [w])[0])

    accumulate()
    before = w.numpy().copy()
    tf.function(lambda: opt.apply([acc.read_value()], [w]))()
    assert_right_size(w, before)
    before = w.numpy().copy()
    scaled = [tf.constant(before * SCALE)]
    tf.function(lambda g: opt.apply([x / 1.0 for x in g], [w]))(scaled)
    assert_right_size(w, before)


@pytest.mark.parametrize("traced_apply", [False, True])
def test_tape_gradients_from_another_function_applied_without_saying_so_are_refused(
    traced_apply,
):
    # The tape ran in a function traced before; its record is there, but the
    # optimizer has handed out unscaled gradients, so an apply that scaled
    # no loss must say which these are (they were divided by 1024 again).
    opt, w = setup()

    @tf.function
    def gradients():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = loss_of(w)
        return tape.gradient(loss, [w])

    gradients()
    before = w.numpy().copy()
    step = maybe_traced(traced_apply)(lambda: opt.apply(gradients(), [w]))
    with pytest.raises(kmp.LossScaleError, match=r"scaled=False"):
        step()
    np.testing.assert_array_equal(w.numpy(), before)


# --- what kmp reads of a traced step is checked before it is trusted --------


@pytest.fixture
def fresh_self_check():
    """The self-check of what kmp reads, run again at its next use."""
    backward.misread_cases.cache_clear()
    yield
    backward.misread_cases.cache_clear()


def test_the_self_check_of_what_kmp_reads_passes_on_this_tensorflow(
    fresh_self_check,
):
    assert backward.misread_cases() == ()


def test_the_self_check_run_inside_a_traced_loop_leaves_the_step_right(
    fresh_self_check,
):
    # The first decision runs the self-check while the step's loop body is
    # being traced: the step still gets its warning and right-sized update.
    opt, w = setup()

    @tf.function
    def step():
        for _ in tf.range(1):
            with tf.GradientTape() as tape:
                loss = loss_of(w)
            opt.apply(tape.gradient(loss, [w]), [w])

    before = w.numpy().copy()
    with pytest.warns(UserWarning, match="never scaled"):
        step()
    assert_right_size(w, before)
    assert backward.misread_cases.cache_info().currsize == 1


def test_a_step_that_never_scales_is_refused_where_tensorflow_changed_what_kmp_reads(
    monkeypatch, fresh_self_check
):
    # A TensorFlow that names a tape's backward pass otherwise: kmp can no
    # longer tell a loss never scaled from a scaled one, so it asks, with
    # the line to write, and changes nothing (it divided the update by the
    # loss scale before).
    monkeypatch.setattr(backward, "_BACKWARD_SCOPE", "no_op_is_named_this/")
    model = linear_model(UnscaledStep, "mixed_float16")
    kmp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = model.get_weights()
    with pytest.raises(
        kmp.LossScaleError,
        match=r"(?s)cannot tell.*optimizer\.scale_loss\(loss\).*scaled=False",
    ):
        model.fit(np.ones((4, 1)), np.full((4, 1), 3.0), batch_size=4, verbose=0)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
