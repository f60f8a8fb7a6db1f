import pathlib
import warnings
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def regression_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32"))


def mlp(name="mlp"):
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ],
        name=name,
    )


def snapshot(model, optimizer):
    return [v.numpy() for v in model.weights] + [
        v.numpy() for v in optimizer.inner_optimizer.variables
    ]


def test_keras_compile_does_not_wrap_kmp_optimizer_again():
    kmp.set_policy("mixed_float16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt


@pytest.mark.parametrize("optimizer", ["sgd", keras.optimizers.SGD, "kmp"])
def test_kmp_compile_scales_the_loss_exactly_once(optimizer):
    x, y = regression_data(16)
    y = y * 0.01  # small errors: no overflow at the default scale of 2**15
    keras.config.set_dtype_policy("float32")
    reference = mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    weights = reference.get_weights()
    reference.train_on_batch(x, y)

    kmp.set_policy("mixed_float16")
    model = mlp()
    model.set_weights(weights)
    if optimizer == "kmp":
        optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=64)
    elif optimizer is keras.optimizers.SGD:
        optimizer = keras.optimizers.SGD(0.01)
    else:
        optimizer = "sgd"  # Keras's default SGD: learning rate 0.01
    kmp.compile(model, optimizer=optimizer, loss="mse")
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert not isinstance(
        model.optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer
    )
    model.train_on_batch(x, y)
    assert model.optimizer.last_step_finite.numpy()  # precondition: applied
    # One scaling: the update matches float32 SGD up to float16 rounding
    # (scaled twice it would be 32768x too large; unscaled twice, too small).
    for got, want, before in zip(
        model.get_weights(), reference.get_weights(), weights, strict=True
    ):
        step_got, step_want = got - before, want - before
        np.testing.assert_allclose(
            step_got, step_want, atol=2e-3 * np.abs(step_want).max() + 1e-6
        )


def test_skipped_step_changes_no_weight_no_slot_and_no_iteration():
    kmp.set_policy("mixed_float16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=256)
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_data(8)
    model.train_on_batch(x, y)
    before = snapshot(model, opt)
    iterations = int(opt.iterations)
    bad = x.copy()
    bad[0, 0] = 1e30  # inf in float16
    model.train_on_batch(bad, y)
    after = snapshot(model, opt)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    assert int(opt.iterations) == iterations
    assert float(opt.loss_scale) == 128.0
    assert int(opt.skipped_steps_total) == 1
    assert not opt.last_step_finite.numpy()


@pytest.mark.slow
def test_fault_injection_with_inf_and_nan_steps_trains_like_a_clean_run():
    x, y = regression_data(512, seed=1)
    y = (y > 0).astype("float32")

    def train(poison):
        keras.utils.set_random_seed(0)
        kmp.set_policy("mixed_float16")
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2), hysteresis=1)
        kmp.compile(
            model, optimizer=opt, loss="binary_crossentropy", metrics=["accuracy"]
        )
        xs = x.copy()
        if poison:
            xs[5 * 32, 0] = np.inf  # batch 5: inf
            xs[9 * 32, 1] = np.nan  # batch 9: NaN
        model.fit(xs, y, batch_size=32, epochs=6, shuffle=False, verbose=0)
        assert all(np.isfinite(w).all() for w in model.get_weights())
        return model.evaluate(x, y, verbose=0)[1], opt

    clean_accuracy, clean_opt = train(False)
    accuracy, opt = train(True)
    # The two poisoned batches recur each epoch: 6 epochs x 2 skips.
    assert int(opt.skipped_steps_total) == 12
    assert int(opt.iterations) == int(clean_opt.iterations) - 12
    assert accuracy > 0.9
    assert abs(accuracy - clean_accuracy) < 0.03


def test_gradients_below_float16_subnormals_train_only_with_scaling():
    x, y = regression_data(32)

    def tiny_mse(y_true, y_pred):
        return 1e-9 * keras.ops.mean(keras.ops.square(y_true - y_pred))

    def kernel_change(mode):
        kmp.set_policy("mixed_float16")
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]
        )
        before = model.layers[0].kernel.numpy().copy()
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1e6), mode=mode)
        model.compile(optimizer=opt, loss=tiny_mse)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        return np.abs(model.layers[0].kernel.numpy() - before).max()

    assert kernel_change("none") == 0.0  # every gradient underflowed to 0
    assert kernel_change("dynamic") > 1e-3


def test_clipping_on_the_inner_optimizer_acts_on_unscaled_gradients():
    kmp.set_policy("mixed_float16")
    var = keras.Variable(np.zeros(3, "float32"))
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0, global_clipnorm=1.0), initial_scale=1024
    )
    scaled = tf.constant([30.0, 40.0, 0.0]) * 1024  # true gradient norm 50
    assert bool(opt.apply([scaled], [var], scaled=True))
    np.testing.assert_allclose(var.numpy(), [-0.6, -0.8, 0.0], rtol=1e-6)


def test_skipped_steps_do_not_advance_a_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(schedule), mode="dynamic")
    var = keras.Variable(0.0)
    opt.apply([tf.constant(np.inf)], [var], scaled=True)
    opt.apply([tf.constant(np.nan)], [var], scaled=True)
    assert int(opt.iterations) == 0
    assert float(opt.inner_optimizer.learning_rate) == 1.0


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_an_explicit_optimizer_scales_whatever_the_global_policy(policy):
    # As Keras's own wrapper (and its tests, and PyTorch's GradScaler): the
    # mode is the optimizer's, not read from the global policy.
    kmp.set_policy(policy)
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=400.0)
    assert opt.mode == "dynamic"
    var = keras.Variable([1.0, 2.0])
    assert not bool(opt.apply([tf.constant([np.inf, 1.0])], [var], scaled=True))
    np.testing.assert_array_equal(var.numpy(), [1.0, 2.0])
    assert float(opt.loss_scale) == 200.0


def test_mode_none_scales_nothing_and_still_skips_non_finite_steps():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), mode="none")
    assert "no scaling" in repr(opt)
    var = keras.Variable(1.0)
    loss = tf.constant(3.0)
    assert float(opt.scale_loss(loss)) == 3.0
    assert bool(opt.apply([tf.constant(2.0)], [var]))
    assert float(var) == 0.0
    assert not bool(opt.apply([tf.constant(np.nan)], [var]))
    assert float(var) == 0.0  # no NaN written
    assert int(opt.skipped_steps_total) == 1 and float(opt.loss_scale) == 1.0


def test_config_round_trip():
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.AdamW(3e-4, clipnorm=1.0),
        initial_scale=512,
        dynamic_growth_steps=10,
        hysteresis=2,
        mode="dynamic",
        max_scale=2.0**20,
    )
    clone = kmp.LossScaleOptimizer.from_config(opt.get_config())
    assert clone.config == opt.config
    assert isinstance(clone.inner_optimizer, keras.optimizers.AdamW)
    assert clone.inner_optimizer.clipnorm == 1.0
    assert clone.get_config() == opt.get_config()


def test_growth_steps_have_one_name_keras_s_and_older_configs_still_load():
    opt = kmp.LossScaleOptimizer("sgd", dynamic_growth_steps=10)
    assert opt.dynamic_growth_steps == 10  # Keras's own attribute agrees
    with pytest.raises(TypeError, match="Write dynamic_growth_steps=10"):
        kmp.LossScaleOptimizer("sgd", growth_interval=10)
    with pytest.raises(TypeError, match="positional"):
        kmp.LossScaleOptimizer("sgd", 2.0**15, 2000, 2.0)  # Keras's order only
    older = opt.get_config()
    older["growth_interval"] = older.pop("dynamic_growth_steps")
    assert kmp.LossScaleOptimizer.from_config(older).config == opt.config


def _train_steps(model, x, y, steps):
    for i in range(steps):
        model.train_on_batch(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8])


def test_save_and_load_restore_the_scale_and_every_counter(tmp_path):
    kmp.set_policy("mixed_float16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        initial_scale=64,
        dynamic_growth_steps=3,
        hysteresis=2,
    )
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_data(64)
    x[20, 0] = 1e30
    _train_steps(model, x, y, 7)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    names = [
        "loss_scale",
        "good_steps",
        "hysteresis_left",
        "skipped_steps_total",
        "consecutive_skips",
        "last_step_finite",
        "iterations",
    ]
    for name in names:
        got = keras.ops.convert_to_numpy(getattr(loaded.optimizer, name))
        assert got == keras.ops.convert_to_numpy(getattr(opt, name)), name
    assert int(opt.skipped_steps_total) == 1  # precondition: a skip happened
    assert loaded.optimizer.config == opt.config
    # The inner optimizer's slots too: a Sequential's layers are built inside
    # the model's name scope, a loaded one's outside it, so the slot names
    # differ (`mlp_dense_kernel_momentum`, `dense_kernel_momentum`).
    before = opt.inner_optimizer.variables
    after = loaded.optimizer.inner_optimizer.variables
    assert len(before) == len(after)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), a.name
        )
    assert np.abs(keras.ops.convert_to_numpy(after[-1])).sum() > 0  # trained


def test_checkpoint_resume_continues_the_same_trajectory(tmp_path):
    x, y = regression_data(96)
    x[50, 2] = 1e30  # one overflow after the checkpoint

    def fresh():
        keras.utils.set_random_seed(0)
        kmp.set_policy("mixed_float16")
        model = mlp()
        opt = kmp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), dynamic_growth_steps=2
        )
        model.compile(optimizer=opt, loss="mse")
        return model, opt

    model, opt = fresh()
    _train_steps(model, x, y, 4)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    saved = checkpoint.save(str(tmp_path / "ckpt"))
    scale_at_checkpoint = float(opt.loss_scale)
    skipped_at_checkpoint = int(opt.skipped_steps_total)
    _train_steps(model, x[32:], y[32:], 8)

    resumed, resumed_opt = fresh()
    resumed.train_on_batch(x[:8], y[:8])  # build the optimizer's variables
    tf.train.Checkpoint(model=resumed, optimizer=resumed_opt).restore(saved)
    assert float(resumed_opt.loss_scale) == scale_at_checkpoint
    _train_steps(resumed, x[32:], y[32:], 8)
    assert int(resumed_opt.skipped_steps_total) == int(opt.skipped_steps_total)
    assert int(opt.skipped_steps_total) > skipped_at_checkpoint  # x[50] overflowed
    assert float(resumed_opt.loss_scale) == float(opt.loss_scale)
    for a, b in zip(resumed.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_holds_the_optimizers_variables_and_none_of_kmps_bookkeeping():
    # kmp's helpers (the ledger, the fused update, a forward watch) are plain
    # objects: a tf.train.Checkpoint tracks only what Keras's optimizer does.
    from kmp.diagnostics import forward_watch

    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam())
    w = keras.Variable([1.0, 2.0])
    opt.apply([tf.constant([1.0, 1.0])], [w], scaled=True)
    forward_watch.watch(opt, keeps_scale=True, counter=tf.Variable(0, tf.int64))
    children = set(tf.train.TrackableView(opt).children(opt))
    assert children == {
        "_iterations",
        "_learning_rate",
        "_trainable_variables",
        "_trainable_variables_indices",
        "_variables",
        "inner_optimizer",
    }
    assert any(v is opt.dynamic_scale for v in opt.variables)  # saved there


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: kmp.LossScaleOptimizer(kmp.LossScaleOptimizer("sgd")),
            ValueError,
            "already a loss-scale optimizer",
        ),
        (
            lambda: kmp.LossScaleOptimizer(
                keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
            ),
            ValueError,
            "scale the loss twice",
        ),
        (
            lambda: kmp.LossScaleOptimizer(object()),
            TypeError,
            "must be a keras.optimizers.Optimizer",
        ),
        (
            lambda: kmp.LossScaleOptimizer("sgd", clipnorm=1.0),
            ValueError,
            "Set it on the inner optimizer",
        ),
        (
            lambda: kmp.LossScaleOptimizer("sgd", initial_scale=0),
            kmp.LossScaleError,
            "positive finite",
        ),
        (
            lambda: kmp.LossScaleOptimizer("sgd", initial_scale=float("nan")),
            kmp.LossScaleError,
            "positive finite",
        ),
        (
            lambda: kmp.LossScaleOptimizer("sgd", backoff_factor=2.0),
            kmp.LossScaleError,
            "backoff_factor",
        ),
        (
            lambda: kmp.LossScaleOptimizer(
                "sgd", min_scale=8.0, max_scale=4.0, initial_scale=4.0
            ),
            kmp.LossScaleError,
            "min_scale",
        ),
        (lambda: kmp.LossScaleOptimizer("sgd", bogus=1), TypeError, "bogus"),
    ],
)
def test_bad_arguments_get_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_integer_losses_are_rejected():
    opt = kmp.LossScaleOptimizer("sgd", mode="dynamic")
    with pytest.raises(TypeError, match="floating-point"):
        opt.scale_loss(tf.constant(3))


def test_scale_is_readable_before_build_and_flags_need_build():
    opt = kmp.LossScaleOptimizer("sgd", mode="dynamic", initial_scale=8.0)
    assert float(opt.loss_scale) == 8.0
    with pytest.raises(ValueError, match=r"created when the\s+optimizer is built"):
        opt.overflow_record.flags  # noqa: B018


def accumulation_model(policy):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)]
    )


def test_gradient_accumulation_matches_keras_when_nothing_overflows():
    x, y = regression_data(32)
    keras.config.set_dtype_policy("float32")
    reference = accumulation_model("float32")
    reference.compile(
        optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
        loss="mse",
    )
    model = accumulation_model("float32")
    model.set_weights(reference.get_weights())
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
        mode="static",
        initial_scale=1024,
    )
    model.compile(optimizer=opt, loss="mse")
    _train_steps(reference, x, y, 4)
    _train_steps(model, x, y, 4)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(opt.iterations) == 2  # optimizer steps, as Keras counts them


def accumulation_recipe(policy, wrap):
    """AdamW + EMA + global_clipnorm + a warm-up schedule + accumulation 2:
    the settings whose counting differed from Keras's."""
    keras.utils.set_random_seed(0)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=40, warmup_target=0.05, warmup_steps=8
    )
    inner = keras.optimizers.AdamW(
        schedule,
        weight_decay=0.01,
        use_ema=True,
        global_clipnorm=1.0,
        gradient_accumulation_steps=2,
    )
    model = accumulation_model(policy)
    if wrap:
        kmp.compile(model, optimizer=inner, loss="mse", fused_update=False)
    else:
        keras.config.set_dtype_policy(policy)
        model.compile(optimizer=inner, loss="mse")
    return model, inner


def test_accumulation_counts_micro_batches_as_keras_does_under_float32():
    x, y = regression_data(64)
    reference, keras_inner = accumulation_recipe("float32", wrap=False)
    model, inner = accumulation_recipe("float32", wrap=True)
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)  # precondition
    model.set_weights(reference.get_weights())
    reference.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
    # The schedule, the EMA and the update count as Keras counts them.
    assert int(inner._iterations) == int(keras_inner._iterations) == 24
    assert int(inner.iterations) == int(keras_inner.iterations) == 12
    assert inner.gradient_accumulation_steps == 2
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(
        inner._model_variables_moving_average,
        keras_inner._model_variables_moving_average,
        strict=True,
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_an_overflowing_micro_batch_is_skipped_alone():
    # Each micro-batch's gradients are unscaled before Keras adds them to its
    # window, so the finite ones already in it stay valid: only the
    # overflowing micro-batch is dropped, and the window closes after two
    # applied micro-batches.
    x, y = regression_data(32)
    model = accumulation_model("mixed_float16")
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
        initial_scale=64,
        dynamic_growth_steps=2,
    )
    model.compile(optimizer=opt, loss="mse")
    initial = [w.numpy() for w in model.weights]
    bad = x.copy()
    bad[8, 0] = 1e30  # the second micro-batch
    model.train_on_batch(bad[:8], y[:8])  # added to the window
    model.train_on_batch(bad[8:16], y[8:16])  # overflows: skipped
    for before, w in zip(initial, model.weights, strict=True):
        np.testing.assert_array_equal(before, w.numpy())
    assert int(opt.inner_optimizer._iterations) == 1  # one micro-batch in
    assert int(opt.skipped_steps_total) == 1
    assert float(opt.loss_scale) == 32.0
    model.train_on_batch(x[16:24], y[16:24])  # closes the window
    assert int(opt.iterations) == 1
    assert not np.array_equal(initial[0], model.weights[0].numpy())
    # The window's update is the mean of the two finite micro-batches.
    reference = accumulation_model("mixed_float16")
    reference.set_weights(initial)
    plain = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=32)
    reference.compile(optimizer=plain, loss="mse")
    both = np.concatenate([x[:8], x[16:24]])
    reference.train_on_batch(both, np.concatenate([y[:8], y[16:24]]))
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-3)


def test_gradient_accumulation_survives_a_config_round_trip():
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, gradient_accumulation_steps=4), mode="dynamic"
    )
    assert opt.inner_optimizer.gradient_accumulation_steps == 4
    clone = kmp.LossScaleOptimizer.from_config(opt.get_config())
    assert clone.inner_optimizer.gradient_accumulation_steps == 4


OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "Adam": lambda: keras.optimizers.Adam(1e-3),
    "AdamW": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01),
    "RMSprop": lambda: keras.optimizers.RMSprop(1e-3),
    "Lion": lambda: keras.optimizers.Lion(1e-4),
    "Adagrad": lambda: keras.optimizers.Adagrad(1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_skips_cleanly_and_applies_finite_steps(name):
    """The same invariants for every inner optimizer."""
    kmp.set_policy("mixed_float16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=128)
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_data(16)
    model.train_on_batch(x[:8], y[:8])
    assert opt.last_step_finite.numpy() and int(opt.iterations) == 1
    before = snapshot(model, opt)
    bad = x[8:].copy()
    bad[0, 0] = np.nan
    model.train_on_batch(bad, y[8:])
    for b, a in zip(before, snapshot(model, opt), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt.iterations) == 1 and float(opt.loss_scale) == 64.0
    model.train_on_batch(x[8:], y[8:])
    assert int(opt.iterations) == 2
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)


def test_sparse_gradients_from_an_embedding_are_unscaled_and_applied():
    kmp.set_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(10, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=256)
    model.compile(optimizer=opt, loss="mse")
    embeddings = model.layers[0].embeddings
    before = embeddings.numpy().copy()
    x = np.array([[1, 2, 3], [1, 2, 3]])
    model.train_on_batch(x, np.ones((2, 1)))
    changed = np.abs(embeddings.numpy() - before).max(axis=1) > 0
    assert changed.tolist() == [i in (1, 2, 3) for i in range(10)]
    assert np.abs(embeddings.numpy() - before).max() < 1.0  # unscaled


def test_float8_scale_variables_are_not_divided_by_the_loss_scale():
    kmp.set_policy("mixed_float16")
    x, y = regression_data(32)
    model = mlp()
    model.build((None, 4))
    model.quantize("float8")
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y * 0.01, batch_size=8, epochs=2, verbose=0)
    scales = [w for w in model.weights if "scale" in w.path]
    assert scales, "precondition: float8 layers have scale variables"
    for w in scales:
        assert np.abs(w.numpy()).min() > 1e-6, w.path  # not divided by 1024 x steps


def test_unknown_arguments_list_the_valid_ones():
    with pytest.raises(TypeError, match="It takes inner_optimizer, initial_scale"):
        kmp.LossScaleOptimizer("sgd", growth=2)


def test_ten_thousand_overflowing_steps_keep_the_floor_and_finite_weights():
    var = keras.Variable(np.ones(3, "float32"))
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(0.1), mode="dynamic", min_scale=1.0
    )
    opt.build([var])
    inf = tf.constant([np.inf, 1.0, np.nan])

    @tf.function
    def overflow_10k():
        for _ in tf.range(10_000):
            opt.apply([inf], [var], scaled=True)

    overflow_10k()
    assert float(opt.loss_scale) == 1.0
    assert int(opt.skipped_steps_total) == 10_000
    assert int(opt.consecutive_skips) == 10_000
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0, 1.0])
    # Keras's own wrapper reaches a scale of 0 here and then writes NaN; kmp's
    # next finite step is an ordinary one.
    assert bool(opt.apply([tf.constant([1.0, 1.0, 1.0])], [var], scaled=True))
    assert np.isfinite(var.numpy()).all() and (var.numpy() < 1.0).all()


def test_applying_to_unknown_variables_is_a_clear_error():
    opt = kmp.LossScaleOptimizer("sgd", mode="dynamic")
    known, stranger = keras.Variable(1.0), keras.Variable(2.0)
    opt.build([known])
    with pytest.raises(ValueError, match="not built with"):
        opt.apply([tf.constant(1.0)], [stranger], scaled=True)


def test_the_tape_leaves_float8_scale_variables_undivided():
    kmp.set_policy("mixed_float16")
    x, y = regression_data(32)
    model = mlp()
    model.build((None, 4))
    model.quantize("float8")
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with kmp.ScaledGradientTape(opt) as tape:
            pred = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_mean(tf.square(pred - y))
        grads = tape.gradient(loss, model.trainable_variables)
        return opt.apply(grads, model.trainable_variables, scaled=False)

    for _ in range(8):
        step(x, y * 0.01)
    scales = [w for w in model.weights if "scale" in w.path]
    assert scales, "precondition: float8 layers have scale variables"
    for w in scales:
        assert np.abs(w.numpy()).min() > 1e-6, w.path  # divided by 1024**8: 1e-24


@pytest.mark.parametrize(
    "value", [np.float32(1024), np.int64(1024), tf.constant(1024.0), np.array(1024)]
)
def test_any_real_number_type_is_accepted_where_a_float_is(value):
    opt = kmp.LossScaleOptimizer(
        "sgd", initial_scale=value, dynamic_growth_steps=np.int64(5)
    )
    assert opt.config.initial_scale == 1024.0 and opt.config.dynamic_growth_steps == 5
    with pytest.raises(kmp.LossScaleError, match="positive finite"):
        kmp.LossScaleOptimizer("sgd", initial_scale=np.float32(-1))
    with pytest.raises(kmp.LossScaleError, match="integer >= 1"):
        kmp.LossScaleOptimizer("sgd", dynamic_growth_steps=np.float32(2.5))


def test_a_sparse_gradient_whose_repeated_rows_sum_past_float16_is_skipped():
    # Each row is finite; the rows of the repeated token sum to inf in
    # float16, as the update would add them (PyTorch checks the summed
    # gradient too).
    kmp.set_policy("float16")
    table = keras.Variable(np.zeros((4, 2), "float16"), dtype="float16")
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), mode="static",
                                 initial_scale=1.0)  # fmt: skip
    values = tf.constant([[60000.0, 1.0], [60000.0, 1.0]], tf.float16)
    grad = tf.IndexedSlices(values, tf.constant([2, 2]), tf.constant([4, 2]))
    assert bool(tf.reduce_all(tf.math.is_finite(values)))
    assert not bool(opt.apply([grad], [table], scaled=True))
    assert np.isfinite(table.numpy().astype("float32")).all()
    assert int(opt.skipped_steps_total) == 1


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32"])
def test_no_policy_writes_a_non_finite_update(policy):
    kmp.set_policy(policy)
    model = mlp()
    kmp.compile(model, optimizer="adam", loss="mse")
    assert model.optimizer.mode == "none"
    x, y = regression_data(32)
    x[9] = np.inf  # batch 2 of 4
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)
    assert history.history["skipped_steps_total"] == [1.0]
    assert "loss_scale" not in history.history


def test_building_inside_strategy_run_is_a_clear_error(mirrored):
    with mirrored.scope():
        var = keras.Variable([1.0, 2.0])
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))

    @tf.function
    def step():
        with kmp.ScaledGradientTape(opt) as tape:
            loss = tf.reduce_sum(var * var) / 2.0
        return opt.apply(tape.gradient(loss, [var]), [var], scaled=False)

    with pytest.raises(
        RuntimeError, match=r"optimizer.build\(model.trainable_variables"
    ):
        mirrored.run(step)
    with mirrored.scope():
        opt.build([var])
    mirrored.run(step)  # built first: runs
    assert np.isfinite(var.numpy()).all() and var.numpy()[0] < 1.0


def _trained(policy="mixed_float16"):
    kmp.set_policy(policy)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ],
        name="named",
    )
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=1024)
    kmp.compile(model, optimizer=opt, loss="mse")
    x, y = regression_data(32)
    x[3] = np.nan  # one skipped step
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return model


def test_saved_state_is_found_by_name_and_holds_no_control_values(tmp_path):
    model = _trained()
    store = {}
    model.optimizer.save_own_variables(store)
    assert int(store["kmp_format"]) == 2
    assert float(store["kmp|loss_scale"]) == float(model.optimizer.loss_scale)
    assert int(store["kmp|skipped_steps_total"]) == 1
    assert not any("pending" in key for key in store)  # a control value
    # Only kmp's own state: Keras saves the inner optimizer (once) itself.
    assert all(k == "kmp_format" or k.startswith("kmp|") for k in store)
    # Found by name: the order of the keys does not matter.
    fresh = _trained()
    fresh.optimizer.dynamic_scale.assign(2.0)
    fresh.optimizer.load_own_variables(dict(reversed(list(store.items()))))
    assert float(fresh.optimizer.loss_scale) == float(model.optimizer.loss_scale)
    assert int(fresh.optimizer.skipped_steps_total) == 1


def test_the_inner_optimizer_state_is_saved_once_and_restored(tmp_path):
    # Keras saves the inner optimizer as a child object by position; kmp no
    # longer saves a second copy (which Keras's load overwrote anyway).
    import h5py

    model = _trained()
    path = tmp_path / "m.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        archive.extract("model.weights.h5", tmp_path)
    keys = []
    with h5py.File(tmp_path / "model.weights.h5") as f:
        f.visit(lambda name: keys.append(name) if "optimizer" in name else None)
    inner = [k for k in keys if k.startswith("optimizer/inner_optimizer/vars/")]
    assert len(inner) == len(model.optimizer.inner_optimizer.variables)
    assert not any("inner|" in k for k in keys)
    loaded = keras.models.load_model(path)
    for a, b in zip(
        loaded.optimizer.inner_optimizer.variables,
        model.optimizer.inner_optimizer.variables,
        strict=True,
    ):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), a.name
        )


def test_a_file_with_an_unknown_or_missing_entry_is_restored_by_name_and_says_so():
    model = _trained()
    store = {}
    model.optimizer.save_own_variables(store)
    store.pop("kmp|good_steps")
    store["kmp|from_the_future"] = np.asarray(1)
    with pytest.warns(UserWarning, match=r"kmp\|good_steps.*kmp\|from_the_future"):
        model.optimizer.load_own_variables(store)


DATA = ROOT / "tests" / "data"


def test_a_keras_file_saved_by_this_version_loads_and_trains_on():
    # tests/data/kmp_optimizer_v2.keras: written by tests/data/make_saved.py
    # with this version (a float16 MLP, one skipped step, scale 512).
    # A change that breaks old files fails here.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing left unrestored
        model = keras.models.load_model(DATA / "kmp_optimizer_v2.keras")
    opt = model.optimizer
    momenta = [v for v in opt.inner_optimizer.variables if "momentum" in v.name]
    assert momenta and all(
        np.abs(keras.ops.convert_to_numpy(v)).sum() > 0 for v in momenta
    )
    assert isinstance(opt, kmp.LossScaleOptimizer)
    assert float(opt.loss_scale) == 512.0
    assert int(opt.skipped_steps_total) == 1
    assert int(opt.inner_optimizer.iterations) == 3
    x, y = regression_data(16)
    model.fit(x, y, batch_size=8, verbose=0)
    assert int(opt.inner_optimizer.iterations) == 5


def test_state_of_another_shape_or_unknown_is_not_restored_and_named():
    kmp.set_policy("mixed_float16")

    def mlp_of(widths):
        layers = [keras.Input((4,))] + [keras.layers.Dense(w) for w in widths]
        return keras.Sequential([*layers, keras.layers.Dense(1)])

    model = mlp_of([8])
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64)
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_data(8)
    bad = x.copy()
    bad[0, 0] = np.inf
    model.train_on_batch(bad, y)  # a skipped step: the overflow record is set
    store = {}
    opt.save_own_variables(store)
    store["kmp|from_another_version"] = np.zeros(2, "float32")
    # Another model: more variables, so its overflow record has more flags.
    fresh = mlp_of([8, 8])
    fresh_opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64)
    fresh.compile(optimizer=fresh_opt, loss="mse")
    fresh_opt.build(fresh.trainable_variables)
    with pytest.warns(UserWarning) as caught:
        fresh_opt.load_own_variables(store)
    message = str(caught[0].message)
    assert "another shape" in message and "overflow_flags" in message
    assert "kmp|from_another_version" in message
    assert float(fresh_opt.loss_scale) == 32.0  # the rest is restored
    assert bool(np.all(fresh_opt.overflow_record.flags.numpy()))  # kept initial


def test_a_variable_without_a_gradient_in_a_micro_batch_is_accumulated_as_keras_does():
    def run(wrap):
        inner = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
        opt = kmp.LossScaleOptimizer(inner, mode="none") if wrap else inner
        a, b = keras.Variable([1.0]), keras.Variable([1.0])
        opt.build([a, b])
        opt.apply([tf.constant([0.4]), tf.constant([0.2])], [a, b])
        opt.apply([tf.constant([0.4]), None], [a, b])
        return a.numpy(), b.numpy()

    (a, b), (keras_a, keras_b) = run(True), run(False)
    np.testing.assert_allclose(a, [0.6])  # mean 0.4
    np.testing.assert_array_equal([a, b], [keras_a, keras_b])


def test_a_float32_sparse_gradient_is_checked_without_finding_its_tokens():
    # float32 rows are checked through their sum (one pass); the per-index
    # sum (tf.unique) is only for 16-bit rows, whose sums overflow easily.
    values = tf.constant([[1.0, 2.0], [3.0, np.nan]])
    grad = tf.IndexedSlices(values, tf.constant([2, 2]), tf.constant([4, 2]))
    graph = tf.function(lambda: kmp.backend.finite.finite_flags([grad]))
    ops = {op.type for op in graph.get_concrete_function().graph.get_operations()}
    assert "Unique" not in ops
    assert not bool(graph()[0])
    assert bool(kmp.backend.finite.finite_flags([tf.IndexedSlices(
        values[:1], tf.constant([2]), tf.constant([4, 2]))])[0])  # fmt: skip
    half = tf.IndexedSlices(tf.cast(values, tf.float16), grad.indices, grad.dense_shape)
    half_ops = tf.function(lambda: kmp.backend.finite.finite_flags([half]))
    assert "Unique" in {
        op.type for op in half_ops.get_concrete_function().graph.get_operations()
    }


def test_stateless_apply_is_for_jax_and_names_the_call_for_tensorflow():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD())
    var = keras.Variable(1.0)
    opt.build([var])
    values = [v.value for v in opt.variables]
    with pytest.raises(NotImplementedError, match=r"call apply\(grads, variables\)"):
        opt.stateless_apply(values, [tf.constant(1.0)], [var.value])
