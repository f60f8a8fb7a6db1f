"""kmp on Keras's JAX backend: `make test` runs this file a second time,
in a process of its own, with `KERAS_BACKEND=jax` and two host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=2`). That process cannot
import TensorFlow (see conftest.py), as where it is not installed."""

import os
import pathlib
import re
import runpy
import subprocess
import sys

import keras
import numpy as np
import pytest

import kmp
from kmp.planning import decisions as planning
from kmp.training import stall

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="runs under KERAS_BACKEND=jax"
)

if keras.backend.backend() == "jax":
    import jax

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )


def data(n=64, poison=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = x[:, :1] * 2.0
    if poison is not None:
        x[poison, 0] = np.inf
    return x, y


def values(variables):
    return [np.array(v.numpy()) for v in variables]


def test_these_tests_run_as_where_tensorflow_is_not_installed():
    with pytest.raises(ModuleNotFoundError, match="tensorflow"):
        import tensorflow  # noqa: F401


def test_kmp_imports_and_trains_without_importing_an_installed_tensorflow(
    tmp_path,
):
    # A fresh process, where TensorFlow is not blocked: where it is
    # installed, kmp must not import it (seconds, and a GiB, for nothing).
    code = (
        "import importlib.util, sys, keras, numpy as np, kmp\n"
        "if importlib.util.find_spec('tensorflow') is None:\n"
        "    sys.exit('TensorFlow is not installed here')\n"
        "kmp.set_policy('mixed_float16')\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])\n"
        "kmp.compile(model, 'adam', 'mse', metrics=['mae'])\n"
        "x, y = np.ones((8, 4)), np.ones((8, 2))\n"
        "monitor = kmp.callbacks.LossScaleMonitor(\n"
        f"    log_dir={str(tmp_path / 'tb')!r}, csv_path={str(tmp_path / 'a.csv')!r})\n"
        "model.fit(x, y, verbose=0,\n"
        "          callbacks=[monitor, kmp.callbacks.NonFiniteGuard()])\n"
        "model.evaluate(x, y, verbose=0)\n"
        "model.predict(x, verbose=0)\n"
        "print(kmp.precision_report(model, sample=(x, y)))\n"
        "print(kmp.debug.precision_audit(model, sample=x))\n"
        "print(kmp.debug.find_nonfinite(model, x), kmp.doctor())\n"
        "print('tensorflow' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


def test_fit_logs_the_scale_and_the_skipped_steps():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "adam", "mse")
    x, y = data()
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0).history
    assert set(history) == {
        "loss",
        "loss_scale",
        "skipped_steps",
        "skipped_steps_total",
    }
    opt = model.optimizer
    assert history["loss_scale"][-1] == float(opt.loss_scale)
    assert history["skipped_steps_total"][-1] == int(opt.skipped_steps_total)
    assert int(opt.iterations) + int(opt.skipped_steps_total) == 8


def test_a_poisoned_batch_is_skipped_and_changes_no_weight_slot_or_iteration():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "adam", "mse")
    x, y = data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    opt = model.optimizer
    weights = values(model.trainable_variables)
    slots = values(opt.inner_optimizer.variables)
    scale, skipped = float(opt.loss_scale), int(opt.skipped_steps_total)
    x, y = data(16, poison=3)
    history = model.fit(x, y, epochs=1, batch_size=16, verbose=0).history
    assert history["skipped_steps"] == [1]
    assert history["skipped_steps_total"] == [skipped + 1]
    assert float(opt.loss_scale) == scale / 2
    for before, after in zip(weights, values(model.trainable_variables), strict=True):
        np.testing.assert_array_equal(before, after)
    for before, after in zip(slots, values(opt.inner_optimizer.variables), strict=True):
        np.testing.assert_array_equal(before, after)
    assert opt.overflow_record.flags.numpy().tolist() == [False] * 4


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32", "bfloat16"])
def test_every_policy_trains_and_skips_a_poisoned_batch_without_scaling(policy):
    kmp.set_policy(policy)
    model = kmp.compile(mlp(), "sgd", "mse")
    assert model.optimizer.mode == "none"
    x, y = data()
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    assert "loss_scale" not in history
    weights = values(model.trainable_variables)
    x, y = data(16, poison=0)
    history = model.fit(x, y, epochs=1, batch_size=16, verbose=0).history
    assert history["skipped_steps"] == [1]
    for before, after in zip(weights, values(model.trainable_variables), strict=True):
        np.testing.assert_array_equal(before, after)


def jitted_step(opt, var):
    """`opt` built for `var`, and a jitted step of a custom loop that
    scales a loss (its gradients are handed over as those of a scaled one)
    and applies them with `stateless_apply`."""
    opt.build([var])

    @jax.jit
    def step(opt_values, grads, var_values):
        with keras.StatelessScope(list(zip(opt.variables, opt_values, strict=True))):
            opt.scale_loss(keras.ops.sum(var_values[0]))
        return opt.stateless_apply(opt_values, grads, var_values)

    return step


def test_stateless_apply_moves_the_scale_as_apply_does_on_tensorflow():
    # growth after 2 finite steps, back off at the 2nd overflow in a row,
    # never below the floor of 2.
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5),
        initial_scale=8.0,
        dynamic_growth_steps=2,
        hysteresis=2,
        min_scale=2.0,
    )
    var = keras.Variable(np.ones(3, "float32"))
    step = jitted_step(opt, var)
    opt_values, var_values = [v.value for v in opt.variables], [var.value]
    scales, weights = [], []
    for finite in [True, True, False, False, False, False, False, True]:
        scale = opt_values[opt.variables.index(opt.dynamic_scale)]
        grad = (
            scale * np.ones(3, "float32") if finite else np.full(3, np.nan, "float32")
        )
        var_values, opt_values = step(opt_values, [grad], var_values)
        scales.append(float(opt_values[opt.variables.index(opt.dynamic_scale)]))
        weights.append(float(var_values[0][0]))
    assert scales == [8.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0, 2.0]
    # Each finite step subtracts 0.5 * 1 (the unscaled gradient); skips none.
    assert weights == [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5]
    for variable, value in zip(opt.variables, opt_values, strict=True):
        variable.assign(value)
    assert int(opt.skipped_steps_total) == 5
    assert int(opt.iterations) == 3
    assert int(opt.inner_optimizer.iterations) == 3


def test_a_run_whose_every_step_overflows_stops_at_the_floor():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "sgd", "mse")
    x = np.full((96, 8), 1e5, "float32")
    with pytest.raises(kmp.callbacks.TrainingCollapsedError) as caught:
        model.fit(x, np.ones((96, 1)), batch_size=1, epochs=1, verbose=0)
    assert "loss scale at its floor (1)" in str(caught.value)
    assert caught.value.cause == "forward"  # from the loss in the logs
    opt = model.optimizer
    # 15 skips halve 2**15 to the floor; the check reads once in
    # QUEUED_AT_MOST steps.
    assert float(opt.loss_scale) == 1.0
    assert int(opt.consecutive_skips) >= stall.STALLED_AFTER
    assert int(opt.skipped_steps_total) <= 16 + 2 * stall.QUEUED_AT_MOST
    # fit wrote its state back: the model is usable.
    assert np.isfinite(model.predict(np.ones((2, 8)), verbose=0)).all()


def test_train_on_batch_returns_the_telemetry():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "adam", "mse")
    x, y = data(16)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["loss_scale"] == float(model.optimizer.loss_scale)
    assert logs["skipped_steps_total"] == int(model.optimizer.skipped_steps_total)


def test_the_telemetry_is_device_arrays_that_outlive_the_donated_state():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "adam", "mse")
    x, y = data(16)
    model.fit(x, y, verbose=0)  # traces the step
    state = tuple(
        [keras.ops.copy(v.value) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    first, state = model.train_function(state, iter([(x, y)]))
    # The next step donates (frees) the state the first returned.
    second, state = model.train_function(state, iter([(x, y)]))
    for logs in (first, second):
        for key in ("loss_scale", "skipped_steps", "skipped_steps_total"):
            assert isinstance(logs[key], jax.Array), key
    assert float(first["loss_scale"]) == float(second["loss_scale"])


def test_fused_update_true_is_refused_with_the_reason():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "adam", "mse", fused_update=True)
    x, y = data(16)
    with pytest.raises(ValueError, match="Keras compiles the whole training step"):
        model.fit(x, y, verbose=0)


class Gan:
    """A GAN's two models and two optimizers, trained in one jitted step:
    Keras's JAX fit carries the state of `model.optimizer` alone, so a
    second optimizer's state travels in a loop of one's own."""

    def __init__(self):
        keras.utils.set_random_seed(0)
        self.g = kmp.prepare(
            keras.Sequential(
                [keras.Input((4,)), keras.layers.Dense(16), keras.layers.Dense(8)]
            )
        )
        self.d = kmp.prepare(
            keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)]
            )
        )
        self.d_opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        self.g_opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        self.d_opt.build(self.d.trainable_variables)
        self.g_opt.build(self.g.trainable_variables)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def variables(self):
        return (
            self.d.trainable_variables,
            self.g.trainable_variables,
            self.d_opt.variables,
            self.g_opt.variables,
        )

    def logits(self, d_values, g_values, z):
        fake, _ = self.g.stateless_call(g_values, [], z)
        return self.d.stateless_call(d_values, [], fake)[0]

    def d_loss(self, d_values, g_values, d_opt_values, real, z):
        real_logits, _ = self.d.stateless_call(d_values, [], real)
        fake_logits = self.logits(d_values, g_values, z)
        loss = self.bce(keras.ops.ones_like(real_logits), real_logits) + self.bce(
            keras.ops.zeros_like(fake_logits), fake_logits
        )
        return self.scaled(self.d_opt, d_opt_values, loss), loss

    def g_loss(self, g_values, d_values, g_opt_values, z, scale):
        logits = self.logits(d_values, g_values, z)
        loss = self.bce(keras.ops.ones_like(logits), logits)
        return (self.scaled(self.g_opt, g_opt_values, loss) if scale else loss), loss

    @staticmethod
    def scaled(optimizer, values, loss):
        mapping = list(zip(optimizer.variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return optimizer.scale_loss(loss)

    def step(self, scale_g_loss=True):
        @jax.jit
        def step(state, real, z):
            d_values, g_values, d_opt_values, g_opt_values = state
            _, grads = jax.value_and_grad(self.d_loss, has_aux=True)(
                d_values, g_values, d_opt_values, real, z
            )
            d_values, d_opt_values = self.d_opt.stateless_apply(
                d_opt_values, grads, d_values
            )
            _, grads = jax.value_and_grad(self.g_loss, has_aux=True)(
                g_values, d_values, g_opt_values, z, scale_g_loss
            )
            g_values, g_opt_values = self.g_opt.stateless_apply(
                g_opt_values, grads, g_values
            )
            return d_values, g_values, d_opt_values, g_opt_values

        return step


def test_a_gan_s_two_optimizers_each_scale_and_skip_their_own_step():
    kmp.set_policy("mixed_float16")
    gan = Gan()
    step = gan.step()
    state = tuple([v.value for v in vs] for vs in gan.variables())
    rng = np.random.default_rng(0)
    real, z = rng.normal(size=(16, 8)), rng.normal(size=(16, 4))
    changed = []
    for poisoned in (False, True, False):
        batch = real.copy()
        if poisoned:
            batch[0, 0] = np.inf  # only the discriminator's loss sees it
        new = step(state, batch.astype("float32"), z.astype("float32"))
        changed.append(
            [
                not all(np.array_equal(a, b) for a, b in zip(old, now, strict=True))
                for old, now in zip(state[:2], new[:2], strict=True)
            ]
        )
        state = new
    for variables, values in zip(gan.variables(), state, strict=True):
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)
    # [discriminator, generator] changed: the poisoned step skipped the
    # discriminator's update alone.
    assert changed == [[True, True], [False, True], [True, True]]
    assert int(gan.d_opt.skipped_steps_total) == 1
    assert int(gan.g_opt.skipped_steps_total) == 0
    assert float(gan.d_opt.loss_scale) == float(gan.g_opt.loss_scale) / 2


def test_a_gan_s_loss_scaled_by_no_optimizer_is_refused_by_its_own():
    # The step differs from the one above only in the generator's loss,
    # left unscaled: the generator's optimizer refuses it.
    kmp.set_policy("mixed_float16")
    gan = Gan()
    state = tuple([v.value for v in vs] for vs in gan.variables())
    x = np.ones((4, 8), "float32")
    with pytest.raises(kmp.LossScaleError, match=r"optimizer.scale_loss\(loss\)"):
        gan.step(scale_g_loss=False)(state, x, np.ones((4, 4), "float32"))


@pytest.mark.skipif(
    keras.backend.backend() == "jax" and len(jax.devices()) < 2,
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2",
)
def test_a_two_device_mesh_skips_a_poisoned_batch_once_for_all_devices():
    kmp.set_policy("mixed_float16")
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        inputs = keras.Input((16, 32))
        h = keras.layers.MultiHeadAttention(4, 8)(inputs, inputs)
        h = keras.layers.LayerNormalization()(h + inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(h))
        model = kmp.compile(model, "adam", "sparse_categorical_crossentropy")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 16, 32)).astype("float32")
        y = rng.integers(0, 4, size=(32,))
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        weights = values(model.trainable_variables)
        iterations = int(model.optimizer.iterations)
        x[1, 0, 0] = np.inf  # on the first device's half of the batch
        history = model.fit(x[:16], y[:16], batch_size=16, verbose=0).history
    finally:
        keras.distribution.set_distribution(None)
    assert history["skipped_steps"] == [1]
    assert int(model.optimizer.iterations) == iterations
    for before, after in zip(weights, values(model.trainable_variables), strict=True):
        np.testing.assert_array_equal(before, after)


def test_a_non_finite_guard_stops_a_collapsed_run_and_names_the_layer():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "sgd", "mse")
    x = np.full((96, 8), 1e5, "float32")
    guard = kmp.callbacks.NonFiniteGuard(
        max_consecutive_skips=4, on_collapse="stop", probe=x[:2]
    )
    model.fit(x, np.ones((96, 1)), batch_size=1, verbose=0, callbacks=[guard])
    assert guard.diagnosis.cause == "forward"
    assert guard.diagnosis.layers == ("hidden",)
    opt = model.optimizer
    # The 15th skip halves 2**15 to the floor, 4 or more in a row there.
    assert float(opt.loss_scale) == 1.0
    assert int(opt.skipped_steps_total) == 15
    assert int(opt.iterations) == 0


def nan_gradients():
    """sqrt(0 * h): the forward pass and the loss are finite, the gradient
    of the layer before it is 0 * inf = NaN."""
    kmp.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, name="before"),
            keras.layers.Lambda(lambda h: keras.ops.sqrt(h * 0.0)),
            keras.layers.Dense(1, name="after"),
        ]
    )
    return kmp.compile(model, "sgd", "mse")


def test_a_run_whose_gradients_are_nan_stops_with_that_cause():
    model = nan_gradients()
    x = np.random.default_rng(0).random((256, 4)).astype("float32")
    with pytest.raises(kmp.callbacks.TrainingCollapsedError) as caught:
        model.fit(x, np.ones((256, 1)), batch_size=4, verbose=0)
    assert caught.value.cause == "gradient"
    assert "without loss scaling" in str(caught.value)


def test_a_non_finite_guard_names_the_layer_whose_gradients_are_nan():
    model = nan_gradients()
    x = np.random.default_rng(0).random((64, 4)).astype("float32")
    guard = kmp.callbacks.NonFiniteGuard(max_consecutive_skips=3, on_collapse="stop")
    model.fit(x, np.ones((64, 1)), batch_size=4, verbose=0, callbacks=[guard])
    assert guard.diagnosis.cause == "gradient"
    assert guard.diagnosis.layers == ("before",)
    assert int(model.optimizer.iterations) == 0


@pytest.mark.parametrize(
    "make, instead",
    [
        (lambda m: kmp.ScaledGradientTape(m.optimizer), "jax.value_and_grad"),
        (lambda m: kmp.callbacks.OverflowHealer(), "kmp.debug.find_nonfinite"),
        (
            lambda m: kmp.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()),
            "Use kmp.LossScaleOptimizer",
        ),
        (
            lambda m: kmp.compile(m, "sgd", "mse", sample=np.ones((2, 8))),
            "Compile without sample=",
        ),
        (
            lambda m: kmp.debug.find_nonfinite(m, np.ones((2, 8)), np.ones((2, 1))),
            "kmp.debug.last_overflow(model)",
        ),
        (
            lambda m: kmp.debug.estimate_memory(m, lambda n: np.ones((n, 8))),
            "memory_stats()",
        ),
        (lambda m: kmp.debug.verify_replicas(m.optimizer), "no replicas to compare"),
        (
            lambda m: kmp.callbacks.LossScaleMonitor(
                underflow_sample=(np.ones((2, 8)), np.ones((2, 1)))
            ),
            "Leave underflow_sample out",
        ),
    ],
    ids=[
        "tape",
        "healer",
        "tf_keras_2_optimizer",
        "compile_sample",
        "backward_search",
        "estimate_memory",
        "verify_replicas",
        "underflow_sample",
    ],
)
def test_what_needs_tensorflow_says_so_and_what_to_do_instead(make, instead):
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "sgd", "mse")
    with pytest.raises(NotImplementedError, match="needs Keras's TensorFlow") as caught:
        make(model)
    assert instead in str(caught.value)


class ScoresAndSoftmax(keras.layers.Layer):
    """Attention of its own: query x key, a softmax, the values."""

    def call(self, x):
        scores = keras.ops.einsum("btd,bsd->bts", x, x)
        return keras.ops.einsum("bts,bsd->btd", keras.ops.softmax(scores), x)


class HalvedExp(keras.layers.Layer):  # exp divided by a constant: no softmax
    def call(self, x):
        return keras.ops.exp(x) / 2.0


class LogSoftmax(keras.layers.Layer):
    def call(self, x):
        return keras.ops.log_softmax(x)


def test_the_op_trace_is_read_from_a_jaxpr_and_names_each_layer():
    kmp.set_policy("mixed_bfloat16")
    tokens = keras.Input((8, 16))
    x = keras.layers.Dense(16, name="proj")(tokens)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = ScoresAndSoftmax(name="attention")(x)
    x = HalvedExp(name="halved")(x)
    x = LogSoftmax(name="logprobs")(x)
    head = keras.layers.Dense(4, activation="softmax", name="head")
    outputs = head(x)
    head.enable_lora(2)  # its kernel, computed from weights, is no query
    traced = kmp.backend.tracing.trace(keras.Model(tokens, outputs))
    assert traced.error is None
    assert traced.outputs == ("bfloat16",)
    norm = traced.of("norm")
    assert norm.returns == ("bfloat16",)  # float32 inside, handed out cast back
    assert {"rsqrt", "reduce_sum"} <= set(norm.float32_ops)
    attention = traced.of("attention")
    assert attention.softmax == ("bfloat16",)
    assert attention.scores == ("bfloat16",)
    assert attention.matmuls == 2 and traced.of("proj").matmuls == 1
    assert traced.of("halved").softmax == ()
    assert traced.of("logprobs").softmax == ("bfloat16",)
    assert traced.of("head").softmax == ("bfloat16",)
    assert traced.of("head").scores == ()


def test_the_report_and_the_audit_read_the_op_trace():
    kmp.set_policy("mixed_float16")

    class Attention(keras.layers.Layer):  # 16-bit scores and softmax
        def call(self, x):
            scores = keras.ops.einsum("btd,bsd->bts", x, x)
            return keras.ops.einsum("bts,bsd->btd", keras.ops.softmax(scores), x)

    model = keras.Sequential(
        [keras.Input((8, 16)), keras.layers.Dense(16), Attention(name="attention")]
    )
    risks = {r.kind for r in kmp.debug.precision_audit(model) if r.layer == "attention"}
    assert {"16-bit softmax", "16-bit attention scores"} <= risks
    report = kmp.compile(mlp(), "sgd", "mse")
    text = str(kmp.precision_report(report))
    assert "Not traced" not in text
    assert "Outputs: float16" in text  # as traced; predict casts them
    assert "Grappler" not in text  # TensorFlow's, which does not run here


def test_the_quickstart_trains_with_the_telemetry(capsys):
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "skipped_steps_total: 0" in out
    assert float(out.rsplit("final accuracy: ", 1)[1]) > 0.5  # chance: 0.1


def test_auto_reads_the_gpus_jax_sees(monkeypatch):
    from kmp.backend import machine

    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"
        compute_capability = "9.0"

    class Rocm:
        device_kind = "AMD Instinct MI210"
        compute_capability = "gfx90a"  # no CUDA compute capability: left out

    def devices(platform=None):
        if platform == "gpu":
            return [Device(), Rocm()]
        raise RuntimeError(f"Unknown backend {platform}")

    monkeypatch.setattr(jax, "devices", devices)
    machine.capabilities.cache_clear()
    try:
        assert machine.capabilities().gpus == (
            machine.GPUInfo("NVIDIA H100 80GB HBM3", (9, 0)),
        )
        assert machine.resolve_auto().policy == "mixed_bfloat16"
    finally:
        machine.capabilities.cache_clear()


def test_the_jitted_custom_loop_example_learns(capsys):
    runpy.run_path(str(EXAMPLES / "jax_custom_loop.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "loss scale" in out
    accuracy = float(re.search(r"train accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.8  # 4 classes: chance is 0.25


class OwnStep(keras.Model):
    """A train_step of its own, as Keras's guide writes one for JAX."""

    def __init__(self, scales_the_loss):
        super().__init__()
        self.scales_the_loss = scales_the_loss
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def loss_for_gradients(self, trainable, non_trainable, optimizer_values, x, y):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
        loss = keras.ops.mean((y - keras.ops.cast(y_pred, "float32")) ** 2)
        scaled = loss
        if self.scales_the_loss:
            mapping = list(zip(self.optimizer.variables, optimizer_values, strict=True))
            with keras.StatelessScope(state_mapping=mapping):
                scaled = self.optimizer.scale_loss(loss)
        return scaled, (loss, non_trainable)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics_values = state
        x, y = data
        (_, (loss, non_trainable)), grads = jax.value_and_grad(
            self.loss_for_gradients, has_aux=True
        )(trainable, non_trainable, optimizer_values, x, y)
        trainable, optimizer_values = self.optimizer.stateless_apply(
            optimizer_values, grads, trainable
        )
        return {"loss": loss}, (
            trainable,
            non_trainable,
            optimizer_values,
            metrics_values,
        )


def test_an_own_train_step_that_scales_the_loss_trains_with_the_telemetry():
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = kmp.compile(OwnStep(scales_the_loss=True), keras.optimizers.SGD(0.05))
    x, y = data()
    history = model.fit(x, y, epochs=3, batch_size=16, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    assert history["loss_scale"][-1] == float(model.optimizer.loss_scale)
    assert history["skipped_steps_total"][-1] == 0


def test_an_own_train_step_that_scales_no_loss_is_refused_with_the_line_to_add():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(OwnStep(scales_the_loss=False), keras.optimizers.SGD(0.05))
    x, y = data()
    with pytest.raises(kmp.LossScaleError, match=r"optimizer.scale_loss\(loss\)"):
        model.fit(x, y, batch_size=16, verbose=0)


def test_an_own_train_step_under_bfloat16_needs_no_scaled_loss():
    kmp.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = kmp.compile(OwnStep(scales_the_loss=False), keras.optimizers.SGD(0.05))
    x, y = data()
    history = model.fit(x, y, epochs=3, batch_size=16, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]


@pytest.mark.skipif(
    keras.backend.backend() == "jax" and len(jax.devices()) < 2,
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2",
)
@pytest.mark.parametrize("built", [False, True], ids=["model", "optimizer_too"])
def test_variables_made_before_the_distribution_are_named_with_the_fix(built):
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "adam", "mse")
    if built:
        model.optimizer.build(model.trainable_variables)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        x, y = data(32)
        with pytest.raises(ValueError, match="Set the distribution first") as caught:
            model.fit(x, y, batch_size=16, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    assert "The variables of the model" in str(caught.value)


@pytest.mark.skipif(
    keras.backend.backend() == "jax" and len(jax.devices()) < 2,
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2",
)
def test_model_parallel_kernels_sharded_over_two_devices_skip_a_poisoned_batch():
    kmp.set_policy("mixed_float16")
    devices = keras.distribution.list_devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    layout_map[".*bias"] = ("model",)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)]
        )
        model = kmp.compile(model, "adam", "mse")
        assert tuple(model.layers[0].kernel.value.sharding.spec) == (None, "model")
        x, y = data(32)
        model.fit(x, np.tile(y, 2), batch_size=16, verbose=0)
        weights = values(model.trainable_variables)
        x, y = data(16, poison=5)
        history = model.fit(x, np.tile(y, 2), batch_size=16, verbose=0).history
    finally:
        keras.distribution.set_distribution(None)
    assert history["skipped_steps"] == [1]
    for before, after in zip(weights, values(model.trainable_variables), strict=True):
        np.testing.assert_array_equal(before, after)


def test_a_floor_below_one_unscales_before_the_check():
    # Below a scale of 1, unscaling can overflow a finite gradient: the
    # gradients are then unscaled first and checked after, as on TensorFlow.
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=1.0, min_scale=2.0**-120
    )
    var = keras.Variable(np.ones(2, "float32"))
    step = jitted_step(opt, var)
    opt_values, var_values = [v.value for v in opt.variables], [var.value]
    for _ in range(120):  # skipped: the scale falls to 2**-120
        nan = np.full(2, np.nan, "float32")
        var_values, opt_values = step(opt_values, [nan], var_values)
    big = np.full(2, 1e30, "float32")  # finite, but 1e30 * 2**120 overflows
    var_values, opt_values = step(opt_values, [big], var_values)
    np.testing.assert_array_equal(var_values[0], [1.0, 1.0])
    scale = opt_values[opt.variables.index(opt.dynamic_scale)]
    assert float(scale) == 2.0**-120


def test_doctor_names_the_backend_and_what_has_no_meaning_here():
    report = kmp.doctor()
    assert report.versions["keras backend"] == "jax"
    assert report.versions["jax"] == jax.__version__
    assert "Not used on Keras's jax backend" in report.fused_update
    assert not report.remapper.managed  # grappler: TensorFlow's


def test_a_loss_scale_monitor_records_the_skipped_step_in_every_format(tmp_path):
    kmp.set_policy("mixed_float16")
    model = kmp.compile(mlp(), "adam", "mse")
    x, y = data(64, poison=3)  # in the first batch of 16
    monitor = kmp.callbacks.LossScaleMonitor(
        log_dir=tmp_path / "tb",
        csv_path=tmp_path / "scale.csv",
        plot_path=tmp_path / "scale.png",
    )
    model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[monitor]
    )
    records = monitor.records
    assert len(records) == 8
    assert records[0].skipped and records[4].skipped  # each epoch's first step
    assert records[0].overflow_layers == ("hidden", "out")
    assert not any(r.skipped for r in records if r.step % 4 != 1)
    assert records[1].loss_scale == records[0].loss_scale == 16384.0
    with open(tmp_path / "scale.csv") as f:
        assert len(f.read().splitlines()) == 1 + 8
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_lora_adapters_train_and_all_zero_ones_are_warned_of_before_the_step():
    kmp.set_policy("mixed_float16")
    model = mlp()
    model.layers[0].enable_lora(2)
    model = kmp.compile(model, "adam", "mse")
    x, y = data()
    history = model.fit(x, y, epochs=3, batch_size=16, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    dead = mlp()
    dead.layers[0].enable_lora(2)
    dead.layers[0].lora_kernel_a.assign(np.zeros((8, 2), "float32"))
    dead = kmp.compile(dead, "adam", "mse")
    with pytest.warns(UserWarning, match="LoRA adapters of .*hidden.* are all zero"):
        dead.fit(x, y, batch_size=16, verbose=0)


def test_a_loss_scaled_in_another_jitted_function_is_stated_with_scaled_true():
    kmp.set_policy("mixed_float16")
    model = mlp()
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0)
    opt.build(model.trainable_variables)
    x, y = data(16)

    @jax.jit
    def gradients(trainable, non_trainable, opt_values):
        def scaled_loss(trainable):
            y_pred, _ = model.stateless_call(trainable, non_trainable, x)
            loss = keras.ops.mean((y - keras.ops.cast(y_pred, "float32")) ** 2)
            mapping = list(zip(opt.variables, opt_values, strict=True))
            with keras.StatelessScope(state_mapping=mapping):
                return opt.scale_loss(loss)

        return jax.grad(scaled_loss)(trainable)

    apply = jax.jit(opt.stateless_apply, static_argnames="scaled")
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    opt_values = [v.value for v in opt.variables]
    grads = gradients(trainable, non_trainable, opt_values)
    apply(opt_values, grads, trainable, scaled=True)  # traced: the count is 0
    # Traced, with no loss scaled since the last apply, and nothing stated:
    with pytest.raises(kmp.LossScaleError, match="scaled=True"):
        jax.jit(opt.stateless_apply)(opt_values, grads, trainable)
    new, _ = apply(opt_values, grads, trainable, scaled=True)
    plain = jax.jit(
        jax.grad(lambda t: gradients_unscaled(model, t, non_trainable, x, y))
    )(trainable)
    for w, g, after in zip(trainable, plain, new, strict=True):
        np.testing.assert_allclose(after, w - 0.01 * g, rtol=2e-2, atol=1e-5)


def gradients_unscaled(model, trainable, non_trainable, x, y):
    y_pred, _ = model.stateless_call(trainable, non_trainable, x)
    return keras.ops.mean((y - keras.ops.cast(y_pred, "float32")) ** 2)


def test_auto_picks_float32_on_a_cpu_whatever_its_16_bit_math():
    from kmp.diagnostics import doctor as doctor_lib
    from kmp.precision import auto

    for flags in (frozenset(), frozenset({"amx_bf16", "avx512_fp16"})):
        choice = auto.choose_policy([], flags, backend="jax")
        assert choice.policy == "float32"
        assert "slower than float32" in choice.reason
    # A GPU still decides as on TensorFlow.
    h100 = [("H100", (9, 0))]
    assert auto.choose_policy(h100, frozenset(), backend="jax").policy == (
        "mixed_bfloat16"
    )
    assert kmp.set_policy("auto").name == "float32"  # this machine has no GPU
    caps = kmp.hardware.capabilities()
    assert "No fast 16-bit path on Keras's jax" in doctor_lib.fast_path(caps)


def test_kmps_lean_layers_compute_as_keras_s_own_on_jax():
    # Their lean computation is TensorFlow's; on JAX each is Keras's layer.
    kmp.set_policy("mixed_float16")
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    pairs = [
        (keras.layers.LayerNormalization, kmp.layers.LayerNormalization, {}),
        (keras.layers.BatchNormalization, kmp.layers.BatchNormalization, {}),
        (
            keras.layers.MultiHeadAttention,
            kmp.layers.MultiHeadAttention,
            {"num_heads": 2, "key_dim": 4},
        ),
    ]
    for keras_class, kmp_class, config in pairs:
        theirs, ours = keras_class(**config), kmp_class(**config)
        args = (x, x) if config else (x,)
        kwargs = (
            {"training": True} if kmp_class is kmp.layers.BatchNormalization else {}
        )
        theirs(*args, **kwargs)
        ours(*args, **kwargs)
        ours.set_weights(theirs.get_weights())
        expected = keras.ops.convert_to_numpy(theirs(*args, **kwargs))
        got = keras.ops.convert_to_numpy(ours(*args, **kwargs))
        assert got.dtype == expected.dtype == np.float16, kmp_class.__name__
        np.testing.assert_array_equal(got, expected, err_msg=kmp_class.__name__)


def second_moment_after(steps, rounding):
    """Adam's second moment of 4096 weights after `steps` gradients of 1
    (exactly 1 - 0.999**steps), each step a jitted `stateless_apply`."""
    variable = keras.Variable(np.zeros(4096, "float32"))
    optimizer = kmp.optimizers.Adam(1e-9, rounding=rounding)
    optimizer.build([variable])
    step = jax.jit(lambda o, w, g: optimizer.stateless_apply(o, [g], w))
    weights, slots = [variable.value], [v.value for v in optimizer.variables]
    for _ in range(steps):
        weights, slots = step(slots, weights, jax.numpy.ones(4096))
    velocity = next(
        i for i, v in enumerate(optimizer.variables) if v is optimizer._velocities[0]
    )
    return np.asarray(slots[velocity], "float64")


def test_bfloat16_moments_round_stochastically_on_jax():
    exact = 1 - 0.999**1500  # 0.777
    stochastic = second_moment_after(1500, "stochastic")
    nearest = second_moment_after(1500, "nearest")
    assert abs(stochastic.mean() - exact) < 0.01 * exact
    assert nearest.mean() < 0.4 * exact  # stuck where a step is below half
    assert len(np.unique(stochastic)) > 1  # each weight draws its own


@pytest.mark.parametrize(
    "name, accumulation", [("Adam", None), ("AdamW", None), ("Adam", 2)]
)
def test_kmps_bfloat16_moment_optimizers_train_as_keras_s_on_jax(name, accumulation):
    def fit(optimizer):
        kmp.set_policy("mixed_float16")
        model = kmp.compile(mlp(), optimizer, "mse")
        x, y = data(256)
        history = model.fit(x, y, epochs=4, batch_size=32, verbose=0)
        return history.history["loss"], model

    settings = {"gradient_accumulation_steps": accumulation}
    keras_s, _ = fit(getattr(keras.optimizers, name)(1e-2, **settings))
    ours, model = fit(getattr(kmp.optimizers, name)(1e-2, **settings))
    assert keras_s[-1] < 0.7 * keras_s[0]  # it trained
    assert abs(ours[-1] - keras_s[-1]) < 0.05 * keras_s[-1]
    moments = model.optimizer.inner_optimizer._momentums
    assert {str(m.dtype) for m in moments} == {"bfloat16"}


def test_jax_rounding_to_bfloat16_refuses_what_it_cannot_do():
    from kmp.backend.jax import rounding

    x = jax.numpy.array([1.0 + 2.0**-9, float("nan"), float("inf")])
    nearest = np.asarray(rounding.to_bfloat16(x, "nearest").astype("float32"))
    assert nearest[0] == 1.0 and np.isnan(nearest[1]) and nearest[2] == np.inf
    stochastic = rounding.to_bfloat16(x, "stochastic", seed=3).astype("float32")
    assert np.isnan(np.asarray(stochastic)[1])  # NaN passed through
    assert np.array_equal(  # the same draw for the same (seed, step, stream)
        np.asarray(stochastic),
        np.asarray(rounding.to_bfloat16(x, "stochastic", seed=3).astype("float32")),
        equal_nan=True,
    )
    with pytest.raises(ValueError, match="needs a seed"):
        rounding.to_bfloat16(x, "stochastic")
    with pytest.raises(ValueError, match="rounding must be"):
        rounding.to_bfloat16(x, "up")


class Head(keras.Model):
    """A subclassed model with a loss of its own: its call's last layer
    hands its output to `compute_loss`, not to Keras's loss."""

    def __init__(self, width=2):
        super().__init__()
        self.width = width
        self.hidden = keras.layers.Dense(8)
        self.head = keras.layers.Dense(width)

    def call(self, x):
        return keras.ops.reshape(self.head(self.hidden(x)), (-1, self.width))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kw):
        return keras.ops.mean(keras.ops.square(y_pred - y))


def test_a_subclassed_models_output_layer_is_read_from_the_jaxpr():
    kmp.set_policy("mixed_float16")
    model = Head()
    model(np.ones((2, 8), "float32"))
    kmp.prepare(model)
    # Its head's output reaches compute_loss in float32, as on TensorFlow.
    assert model.head.compute_dtype == "float32"
    assert model.hidden.compute_dtype == "float16"
    kmp.compile(model, keras.optimizers.SGD(0.01))
    x, y = data(32)
    y = np.concatenate([y, -y], axis=1)  # the head's two outputs
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]


def test_an_output_its_call_joins_with_a_16_bit_tensor_keeps_its_dtype():
    # As on TensorFlow: in float32, the head's output would meet the 16-bit
    # hidden tensor in the call's own code (raw jax.lax refuses that;
    # jax.numpy would silently compute it in float32).
    class Mixes(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(3)
            self.head = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            h = self.hidden(x)
            p = self.head(h)
            return p, jax.lax.sub(p, h)

    kmp.set_policy("mixed_bfloat16")
    model = Mixes()
    model(np.ones((2, 4), "float32"))
    kmp.prepare(model)
    assert model.head.compute_dtype == "bfloat16"
    note = planning.plan(model).decision(model.head.name).note
    assert "would meet a 16-bit tensor in sub in Mixes" in note


def test_token_ids_a_layer_hands_only_to_its_embedding_are_read_from_the_jaxpr():
    class Passes(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(20000, 4)

        def call(self, x):
            return self.embed(x) * 2.0

    class AddsATable(Passes):
        def call(self, x):  # a constant, as a position table: not an input
            return self.embed(x) + np.ones((3, 4), "float32")

    class UsesThem(Passes):
        def call(self, x):
            return self.embed(x) + keras.ops.expand_dims(x, -1)

    kmp.set_policy("mixed_bfloat16")
    ids = keras.Input((3,))  # float32 token ids, as in keras-io's examples
    passes, table, uses = Passes(), AddsATable(), UsesThem()
    added = keras.layers.Add()([passes(ids), table(ids), uses(ids)])
    model = keras.Model(ids, keras.layers.Dense(2)(added))
    kmp.prepare(model)
    plan = planning.plan(model)
    assert plan.decision(passes.name).rule == planning.TOKEN_IDS
    assert plan.decision(table.name).rule == planning.TOKEN_IDS
    x = np.array([[19999.0, 19998.0, 3.0]], "float32")
    rows = np.asarray(passes(x), "float32")
    assert not np.allclose(rows[0, 0], rows[0, 1])  # 19999 was not rounded
    assert uses.compute_dtype == "bfloat16"
    assert "would change what it returns" in plan.decision(uses.name).note


@pytest.mark.parametrize("returns_scores", [False, True])
def test_attention_scores_that_leave_the_layer_are_read_from_the_jaxpr(
    returns_scores,
):
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="block")
            # dropout > 0: Keras computes the scores with its Softmax layer.
            self.att = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)

        def call(self, x):
            if returns_scores:
                y, scores = self.att(x, x, return_attention_scores=True)
                return keras.ops.multiply(y, keras.ops.mean(scores))
            return x + self.att(x, x)

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((5, 8))
    block = Block()
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(2)(block(inputs))))
    softmax = f"block/{block.att.name}/{block.att._softmax.name}"
    rule = planning.plan(model).decision(softmax).rule
    if returns_scores:  # what the caller receives keeps its dtype
        assert (rule, block.att._softmax.compute_dtype) == (
            planning.SCORES_KEPT,
            "float16",
        )
    else:
        assert (rule, block.att._softmax.compute_dtype) == (
            planning.ATTENTION_SCORES,
            "float32",
        )
    assert block.att.query_dense.compute_dtype == "float32"
    assert np.isfinite(model.predict(np.ones((2, 5, 8)), verbose=0)).all()


def test_float16_sums_xla_cannot_run_on_a_cpu_are_named_with_the_fix():
    # KerasHub's Llama attention: jax.numpy's einsum sums float16 products
    # in float32, which XLA's CPU code refuses (plain Keras fails there too).
    keras_hub = pytest.importorskip("keras_hub")
    if jax.devices()[0].platform != "cpu":
        pytest.skip("XLA runs these products on GPUs and TPUs")
    kmp.set_policy("mixed_float16")
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_query_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        num_key_value_heads=1,
    )
    logits = keras.layers.Dense(50)(backbone.output)  # no KerasHub pipeline
    model = keras.Model(backbone.input, logits)
    kmp.compile(
        model, "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    tokens = np.ones((2, 6), "int32")
    x = {"token_ids": tokens, "padding_mask": np.ones((2, 6), bool)}
    with pytest.raises(ValueError, match=r"(?s)XLA's CPU.*'mixed_bfloat16'"):
        model.fit(x, tokens, batch_size=2, verbose=0)


class Noisy(Head):
    """A `Head` whose call draws noise (a SeedGenerator, whose state is a
    random key), as a VAE's sampling does."""

    def __init__(self):
        super().__init__(width=1)
        self.seed = keras.random.SeedGenerator(0)

    def call(self, x):
        h = self.hidden(x)
        noise = keras.random.normal(keras.ops.shape(h), seed=self.seed)
        return self.head(h + keras.ops.cast(noise, h.dtype))


def test_a_call_that_draws_from_a_seed_generator_is_read_from_the_jaxpr():
    kmp.set_policy("mixed_float16")
    model = Noisy()
    model(np.ones((2, 8), "float32"))
    kmp.compile(model, keras.optimizers.SGD(0.01))
    assert model.head.compute_dtype == "float32"  # its output reaches the loss
    assert kmp.precision_report(model).not_traced == ""
    history = model.fit(*data(32), batch_size=8, verbose=0).history
    assert np.isfinite(history["loss"]).all()
