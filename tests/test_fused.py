"""The fused (XLA-compiled) optimizer update: same numbers, same skips, used
where kmp says it is, refused where it cannot run."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.backend import fused
from kmp.backend import machine
from kmp.tools import bench
from kmp.tools import demo


def mlp():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, np.tanh(x.sum(axis=1, keepdims=True))


# Every built-in Keras optimizer, with the options that add work to the
# update (clipping, weight decay, EMA, a schedule, AMSGrad, Nesterov).
OPTIMIZERS = {
    "SGD+nesterov": lambda: keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True),
    "Adam+clipnorm": lambda: keras.optimizers.Adam(1e-3, clipnorm=1.0),
    "Adam+amsgrad+ema": lambda: keras.optimizers.Adam(
        1e-3, amsgrad=True, use_ema=True, ema_overwrite_frequency=2
    ),
    "Adam+schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-3, 2, 0.5)
    ),
    "AdamW": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05),
    "Adamax": lambda: keras.optimizers.Adamax(1e-3),
    "Nadam": lambda: keras.optimizers.Nadam(1e-3),
    "RMSprop": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.5, centered=True),
    "Adagrad": lambda: keras.optimizers.Adagrad(1e-2),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Adafactor": lambda: keras.optimizers.Adafactor(1e-2),
    "Ftrl": lambda: keras.optimizers.Ftrl(1e-2, l1_regularization_strength=1e-3),
    "Lamb": lambda: keras.optimizers.Lamb(1e-3),
    "Lion": lambda: keras.optimizers.Lion(1e-4, global_clipnorm=1.0),
    # kmp's own, with bfloat16 moments (each draw of stochastic rounding is
    # the same fused as unfused).
    "kmp.Adam+amsgrad": lambda: kmp.optimizers.Adam(1e-3, amsgrad=True),
    "kmp.AdamW+nearest": lambda: kmp.optimizers.AdamW(1e-3, rounding="nearest"),
}


def test_every_class_fused_by_default_is_checked_here():
    classes = {type(make()) for make in OPTIMIZERS.values()}
    assert classes == set(fused.TESTED) | {kmp.optimizers.Adam, kmp.optimizers.AdamW}
    assert all(fused.is_tested(cls()) for cls in classes)


def train(make_optimizer, fused_update, steps=4):
    """Four updates of an MLP's variables from the same scaled gradients (the
    loss scale times values whose norm is well above 1, so that clipping
    clips), eagerly: the fused update is the same XLA program eagerly as in a
    train step, and the plain one Keras's own code."""
    kmp.set_policy("mixed_float16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(
        make_optimizer(), initial_scale=128, fused_update=fused_update
    )
    variables = model.trainable_variables
    opt.build(variables)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        grads = [
            tf.constant(128 * rng.normal(size=v.shape).astype("float32"))
            for v in variables
        ]
        opt.apply(grads, variables, scaled=True)
    return model, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_fused_update_computes_what_keras_computes(name):
    plain_model, plain = train(OPTIMIZERS[name], fused_update=False)
    fused_model, fast = train(OPTIMIZERS[name], fused_update=True)
    assert not plain._fused_apply._functions  # the plain path was taken
    assert fast._fused_apply._functions  # and the fused one here, by XLA
    assert all(f._jit_compile for f in fast._fused_apply._functions.values())
    assert int(fast.iterations) == int(plain.iterations) == 4
    for a, b in zip(
        plain_model.weights + plain.inner_optimizer.variables,
        fused_model.weights + fast.inner_optimizer.variables,
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(b, "float64"), np.asarray(a, "float64"), rtol=2e-5, atol=1e-6
        )
    # The updates did something (the comparison is not of two unchanged models).
    assert not np.allclose(plain_model.weights[0].numpy(), mlp().weights[0].numpy())


def test_a_skipped_step_changes_nothing_with_the_fused_update():
    kmp.set_policy("mixed_float16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), fused_update=True)
    model.compile(optimizer=opt, loss="mse")
    x, y = data(32)
    model.train_on_batch(x[:16], y[:16])
    before = [v.numpy() for v in model.weights + opt.inner_optimizer.variables]
    bad = x[16:].copy()
    bad[0, 0] = np.inf
    model.train_on_batch(bad, y[16:])
    after = [v.numpy() for v in model.weights + opt.inner_optimizer.variables]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt.skipped_steps_total) == 1 and int(opt.iterations) == 1


def test_sparse_embedding_gradients_are_fused_like_dense_ones():
    def run(fused_update):
        kmp.set_policy("mixed_bfloat16")
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1),
            ]
        )
        opt = kmp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), fused_update=fused_update
        )
        model.compile(optimizer=opt, loss="mse")
        before = model.layers[0].embeddings.numpy()
        # Different rows each step (43..49 never) and batches of 8, 8 and 5
        # rows: the sparse gradient's shape follows the batch.
        for step, rows in enumerate((8, 8, 5)):
            x = (np.arange(5 * rows).reshape(rows, 5) + 3 * step) % 45
            model.train_on_batch(x, np.ones((rows, 1)))
        return opt, before, model.layers[0].embeddings.numpy()

    (_, _, plain), (opt, before, fast) = run(False), run(True)
    (function,) = opt._fused_apply._functions.values()
    # Made dense at the variable's shape before XLA: one program, whatever
    # the batch (XLA compiles one program per input shape).
    assert function.experimental_get_tracing_count() == 1
    signature = function.pretty_printed_concrete_signatures()
    assert "IndexedSlices" not in signature
    assert "TensorSpec(shape=(50, 8), dtype=tf.float32" in signature
    np.testing.assert_allclose(fast, plain, rtol=1e-5, atol=1e-7)
    assert np.abs(fast[:43] - before[:43]).min() > 0
    np.testing.assert_array_equal(fast[43:], before[43:])


def test_eager_custom_loop_fuses_per_variable_list():
    kmp.set_policy("mixed_float16")
    a, b = keras.Variable(np.ones(4, "float32")), keras.Variable(np.ones(3, "float32"))
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), fused_update=True)
    opt.build([a, b])
    scale = float(opt.loss_scale)
    opt.apply([tf.fill((4,), scale), tf.fill((3,), scale)], [a, b], scaled=True)
    opt.apply([tf.fill((4,), scale)], [a], scaled=True)  # a second list of variables
    np.testing.assert_allclose(a.numpy(), np.zeros(4))  # 1 - 0.5 - 0.5
    np.testing.assert_allclose(b.numpy(), np.full(3, 0.5))
    assert len(opt._fused_apply._functions) == 2
    for _ in range(5):  # more eager steps reuse the traced programs
        opt.apply([tf.zeros((4,)), tf.zeros((3,))], [a, b], scaled=True)
    assert [
        f.experimental_get_tracing_count() for f in opt._fused_apply._functions.values()
    ] == [1, 1]


def test_default_fuses_only_on_machines_without_accelerators(monkeypatch):
    caps = machine.capabilities()
    assert fused.resolve(None) == (not caps.gpus and not caps.tpus)
    with_gpu = dataclasses.replace(caps, gpus=(machine.GPUInfo("NVIDIA H100", (9, 0)),))
    monkeypatch.setattr(machine, "capabilities", lambda: with_gpu)
    assert fused.resolve(None) is False
    assert fused.resolve(True) is True
    assert fused.resolve(False) is False


def test_the_default_fuses_an_update_by_its_number_of_weights(monkeypatch):
    """The decision follows the variables the update touches, the same on
    every run: no timing is involved."""
    monkeypatch.setattr(fused, "default_for_machine", lambda: True)
    at_threshold = [
        keras.Variable(np.zeros((1000, 999))),
        keras.Variable(np.zeros(1000)),
    ]
    below = [keras.Variable(np.zeros((1000, 999)))]
    assert fused.weights_of(at_threshold) == fused.MIN_WEIGHTS == 1_000_000
    assert fused.resolve(None, "adam", at_threshold)
    assert not fused.resolve(None, "adam", below)
    assert fused.resolve(True, "adam", below)  # True forces it
    assert not fused.resolve(False, "adam", at_threshold)
    # Keras's gradient accumulation, compiled into the program, held about
    # three times the gradients more than unfused: not fused by default.
    accumulating = keras.optimizers.AdamW(gradient_accumulation_steps=2)
    assert not fused.resolve(None, accumulating, at_threshold)
    assert fused.resolve(True, accumulating, at_threshold)
    # The built-in benchmark models: the MLP (12.6 M weights) and the
    # transformer (3.6 M) are fused, the small CNN (0.31 M) is not: fusing
    # its update made its whole step slower. The digits demo's MLP (8.5 M)
    # is fused, its CNN (0.15 M) is not.
    decisions = {
        name: fused.resolve(
            None, "adam", bench.build_model(name)[0].trainable_variables
        )
        for name in bench.BUILTIN_MODELS
    }
    assert decisions == {"mlp": True, "cnn": False, "transformer": True}
    assert fused.resolve(None, "adam", demo.build_model("mlp").trainable_variables)
    assert not fused.resolve(None, "adam", demo.build_model("cnn").trainable_variables)

    # Through kmp.compile and fit: a model's own update decides, every time.
    kmp.set_policy("mixed_bfloat16")
    for min_weights, fuses in ((10**9, False), (1, True), (10**9, False)):
        monkeypatch.setattr(fused, "MIN_WEIGHTS", min_weights)
        model = kmp.compile(mlp(), optimizer="adam", loss="mse")
        model.fit(*data(32), verbose=0)
        assert bool(model.optimizer._fused_apply._functions) == fuses


@pytest.mark.parametrize("machine_fuses", [True, False])
def test_kmp_compile_wraps_alike_on_every_machine(monkeypatch, machine_fuses):
    monkeypatch.setattr(fused, "default_for_machine", lambda: machine_fuses)
    monkeypatch.setattr(fused, "MIN_WEIGHTS", 1)  # this small MLP counts
    loss = "mse"

    kmp.set_policy("mixed_bfloat16")
    model = kmp.compile(mlp(), optimizer="adam", loss=loss)
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert model.optimizer.mode == "none"
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.Adam)
    model.fit(*data(32), verbose=0)
    # Fused only where the machine calls for it; wrapped everywhere.
    assert bool(model.optimizer._fused_apply._functions) == machine_fuses

    # Asked not to: wrapped (non-finite steps are skipped), not fused.
    model = kmp.compile(mlp(), optimizer="adam", loss=loss, fused_update=False)
    assert model.optimizer.mode == "none" and model.optimizer.fused_update is False

    kmp.set_policy("float32")  # float32: the same rule
    model = kmp.compile(mlp(), optimizer="adam", loss=loss)
    assert model.optimizer.mode == "none" and model.optimizer.fused_update is None
    model.fit(*data(32), verbose=0)
    assert bool(model.optimizer._fused_apply._functions) == machine_fuses
    model = kmp.compile(mlp(), optimizer="adam", loss=loss, fused_update=True)
    assert model.optimizer.mode == "none" and model.optimizer.fused_update

    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), optimizer="adam", loss=loss, fused_update=False)
    assert model.optimizer.mode == "dynamic" and model.optimizer.fused_update is False


def test_bfloat16_pass_through_computes_what_keras_computes():
    kmp.set_policy("mixed_bfloat16")
    x, y = data()
    models = []
    for fused_update in (False, True):
        model = kmp.compile(
            mlp(), optimizer=keras.optimizers.Adam(1e-2), loss="mse",
            fused_update=fused_update,
        )  # fmt: skip
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
        models.append(model)
    plain, fast = models
    assert not plain.optimizer._fused_apply._functions
    assert fast.optimizer._fused_apply._functions
    for a, b in zip(plain.weights, fast.weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=2e-5, atol=1e-6)


def test_gradient_accumulation_is_fused_like_unfused():
    def run(fused_update):
        kmp.set_policy("mixed_float16")
        model = mlp()
        inner = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2)
        opt = kmp.LossScaleOptimizer(
            inner, initial_scale=128, fused_update=fused_update
        )
        model.compile(optimizer=opt, loss="mse")
        x, y = data()
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        return model, opt

    (plain, _), (fast, opt) = run(False), run(True)
    assert opt._fused_apply._functions and int(opt.iterations) == 4
    for a, b in zip(plain.weights, fast.weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=2e-5, atol=1e-6)


def test_kmp_compile_rejects_bad_fused_update_arguments():
    kmp.set_policy("mixed_float16")
    with pytest.raises(TypeError, match=r"fused_update must be None.*'yes'"):
        kmp.compile(mlp(), optimizer="adam", loss="mse", fused_update="yes")
    with pytest.raises(ValueError, match="Set it there instead"):
        kmp.compile(
            mlp(),
            optimizer=kmp.LossScaleOptimizer("adam"),
            loss="mse",
            fused_update=True,
        )
    with pytest.raises(TypeError, match="fused_update must be None"):
        kmp.LossScaleOptimizer("adam", fused_update=1)


def test_fused_update_true_under_a_strategy_is_a_clear_error(mirrored):
    kmp.set_policy("mixed_float16")
    with mirrored.scope():
        model = mlp()
        opt = kmp.LossScaleOptimizer("sgd", fused_update=True)
        model.compile(optimizer=opt, loss="mse")
    with pytest.raises(ValueError, match="fused_update=True cannot be used under"):
        model.fit(*data(32), verbose=0)


def test_default_does_not_fuse_under_a_strategy(monkeypatch, mirrored):
    monkeypatch.setattr(fused, "default_for_machine", lambda: True)
    # bfloat16: the pass-through applies in replica context, where the
    # fusion is decided (float16 under Mirrored applies via merge_call).
    kmp.set_policy("mixed_bfloat16")
    with mirrored.scope():
        model = kmp.compile(mlp(), optimizer="sgd", loss="mse")
    assert model.optimizer.mode == "none"
    before = model.layers[0].kernel.numpy()
    model.fit(*data(32), verbose=0)
    assert not model.optimizer._fused_apply._functions
    assert int(model.optimizer.iterations.numpy()) == 1
    assert not np.array_equal(model.layers[0].kernel.numpy(), before)


def test_the_setting_survives_saving(tmp_path):
    kmp.set_policy("mixed_float16")
    model = mlp()
    model.compile(
        optimizer=kmp.LossScaleOptimizer("adam", fused_update=False), loss="mse"
    )
    model.fit(*data(32), verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert keras.saving.load_model(path).optimizer.fused_update is False
    config = model.optimizer.get_config()
    assert kmp.LossScaleOptimizer.from_config(config).fused_update is False
    config["fused_update"] = True
    assert kmp.LossScaleOptimizer.from_config(config).fused_update is True
    del config["fused_update"]  # as kmp wrote it before the setting existed
    assert kmp.LossScaleOptimizer.from_config(config).fused_update is None
    assert "fused_update" not in kmp.LossScaleOptimizer("sgd").get_config()


class MySGD(keras.optimizers.SGD):
    """A user's optimizer class: its update might use ops XLA cannot compile."""


def test_your_own_optimizer_class_is_fused_only_when_asked(monkeypatch):
    monkeypatch.setattr(fused, "default_for_machine", lambda: True)
    assert not fused.is_tested(keras.optimizers.Muon())  # untested classes
    assert fused.is_tested("adam") and fused.is_tested(keras.optimizers.Lion())
    kmp.set_policy("mixed_bfloat16")
    model = kmp.compile(mlp(), optimizer=MySGD(0.01), loss="mse")
    model.fit(*data(32), verbose=0)
    assert type(model.optimizer.inner_optimizer) is MySGD
    assert not model.optimizer._fused_apply._functions  # untested: not fused
    model = kmp.compile(mlp(), optimizer=MySGD(0.01), loss="mse", fused_update=True)
    model.fit(*data(32), verbose=0)
    assert model.optimizer._fused_apply._functions
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), optimizer=MySGD(0.01), loss="mse")
    model.fit(*data(32), verbose=0)
    assert not model.optimizer._fused_apply._functions


def test_a_learning_rate_set_between_steps_reaches_the_fused_update():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.compile(
        mlp(), optimizer=keras.optimizers.SGD(0.1), loss="mse", fused_update=True
    )
    x, y = data(32)
    model.fit(x, y, batch_size=16, verbose=0)
    assert model.optimizer._fused_apply._functions
    model.optimizer.learning_rate = 0.0  # as ReduceLROnPlateau sets it
    assert float(model.optimizer.inner_optimizer.learning_rate) == 0.0
    before = [w.numpy() for w in model.weights]
    model.fit(x, y, batch_size=16, verbose=0)
    for b, w in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(w.numpy(), b)
    assert int(model.optimizer.iterations) == 4


def test_steps_per_execution_runs_the_fused_update_every_step():
    def run(fused_update):
        kmp.set_policy("mixed_bfloat16")
        model = mlp()
        model = kmp.compile(
            model, optimizer=keras.optimizers.Adam(1e-2), loss="mse",
            fused_update=fused_update, steps_per_execution=4,
        )  # fmt: skip
        model.fit(*data(), batch_size=8, verbose=0, shuffle=False)
        return model

    plain, fast = run(False), run(True)
    assert fast.optimizer._fused_apply._functions
    assert int(fast.optimizer.iterations) == 8
    for a, b in zip(plain.weights, fast.weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=2e-5, atol=1e-6)


def test_the_inner_optimizers_own_accumulation_is_fused_under_bfloat16():
    """Under a pass-through, Keras's own gradient accumulation runs inside
    the fused program."""

    def run(fused_update):
        kmp.set_policy("mixed_bfloat16")
        inner = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2)
        model = kmp.compile(
            mlp(), optimizer=inner, loss="mse", fused_update=fused_update
        )
        model.fit(*data(), batch_size=8, verbose=0, shuffle=False)
        return model

    plain, fast = run(False), run(True)
    assert fast.optimizer._fused_apply._functions
    assert int(fast.optimizer.iterations) == 4  # 8 micro-batches, in pairs
    for a, b in zip(plain.weights, fast.weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=2e-5, atol=1e-6)


def test_op_determinism_keeps_the_default_unfused(monkeypatch):
    from tensorflow.python.framework import config

    monkeypatch.setattr(fused, "default_for_machine", lambda: True)
    assert fused.resolve(None)
    tf.config.experimental.enable_op_determinism()  # read through TensorFlow
    try:
        assert not fused.resolve(None)
        assert fused.resolve(True)
    finally:
        config.disable_op_determinism()  # no public way back; tests only
    assert fused.resolve(None)


def test_a_variable_of_unknown_shape_is_updated_unfused_by_default(monkeypatch):
    monkeypatch.setattr(fused, "default_for_machine", lambda: True)
    monkeypatch.setattr(fused, "MIN_WEIGHTS", 1)
    variable = tf.Variable(np.ones((2, 4), "float32"), shape=tf.TensorShape([None, 4]))
    assert fused.weights_of([variable]) is None
    assert not fused.resolve(None, "sgd", [variable])  # XLA needs static shapes
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), mode="none")
    opt.apply([tf.ones((2, 4))], [variable])
    np.testing.assert_allclose(variable.numpy(), np.full((2, 4), 0.5))
    assert not opt._fused_apply._functions


def test_the_update_compiled_ahead_changes_nothing_and_is_the_one_steps_run():
    kmp.set_policy("mixed_bfloat16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), fused_update=True)
    kmp.compile(model, optimizer=opt, loss="mse")
    before = [v.numpy() for v in model.weights]
    assert fused.compile_ahead(opt, model.trainable_variables)
    assert opt.built and int(opt.iterations) == 0
    for b, v in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(v.numpy(), b)
    built = keras.optimizers.Adam(1e-3)  # as build alone leaves them
    built.build(model.trainable_variables)
    for a, b in zip(opt.inner_optimizer.variables, built.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not fused.compile_ahead(opt, model.trainable_variables)  # once
    (function,) = opt._fused_apply._functions.values()
    model.train_on_batch(*data(16))
    assert int(opt.iterations) == 1
    assert not np.allclose(model.weights[0].numpy(), before[0])
    # The train step ran the program compiled ahead: no second trace.
    assert function.experimental_get_tracing_count() == 1
    # Nothing to compile where the update is not fused.
    plain = kmp.LossScaleOptimizer(keras.optimizers.Adam(), fused_update=False)
    assert not fused.compile_ahead(plain, mlp().trainable_variables)
    assert not plain.built


class OwnStep(keras.Model):
    """Trains only its last layer, with a train_step of its own."""

    def __init__(self):
        super().__init__()
        self.body = keras.layers.Dense(32, activation="relu")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.body(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        variables = self.head.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables, scaled=False)
        return {"loss": loss}


def test_fit_compiles_the_update_ahead_for_keras_own_train_step_only(monkeypatch):
    calls = []
    original = fused.FusedApply.compile_ahead

    def spy(self, variables):
        calls.append((list(variables), int(self._optimizer.iterations)))
        return original(self, variables)

    monkeypatch.setattr(fused.FusedApply, "compile_ahead", spy)
    kmp.set_policy("mixed_bfloat16")
    model = kmp.compile(mlp(), optimizer="adam", loss="mse", fused_update=True)
    model.fit(*data(32), batch_size=16, epochs=2, verbose=0)
    ((variables, iterations),) = calls  # once, before the first step
    assert iterations == 0
    assert [id(v) for v in variables] == [id(v) for v in model.trainable_variables]
    (function,) = model.optimizer._fused_apply._functions.values()
    assert function.experimental_get_tracing_count() == 1

    # Where Keras compiles the whole step with XLA, the update is inside it.
    whole = kmp.compile(
        mlp(), optimizer="adam", loss="mse", fused_update=True, jit_compile=True
    )
    whole.fit(*data(32), batch_size=16, verbose=0)
    assert len(calls) == 1

    # A train_step of the model's own may apply other variables: nothing is
    # compiled ahead, and the one update compiled is the one it applies.
    calls.clear()
    own = OwnStep()
    own(np.zeros((1, 6), "float32"))  # built
    kmp.compile(own, optimizer="adam", fused_update=True)
    own.fit(*data(32), batch_size=16, verbose=0)
    assert not calls
    assert list(own.optimizer._fused_apply._functions) == [
        tuple(id(v) for v in own.head.trainable_variables)
    ]
