"""Memory: kmp's training step holds no more than plain Keras's.

Read from TensorFlow's profiler (the bytes the live tensors requested, and
their peak: `benchmarks/_allocations.py`), on a model whose weights and
optimizer state outweigh its activations, so that a copy of the weights or
of Adam's slots, made by the skip of a non-finite step or by the fused
update, would show at once (one copy of the weights is 16 MiB here, the
margin 1 MiB).
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from processes import in_fresh_process

import kmp
from benchmarks._allocations import live_at_peak
from kmp.backend import fused

MIB = 2**20


def wide_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2048,))
    hidden = keras.layers.Dense(2048, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10)(hidden))


def tensors_rise(way: str, policy: str, trace_dir: str) -> int:
    """The peak, over two epochs of `fit` (8 steps each), of the bytes of the
    tensors that the training steps allocate and hold at once (above what
    was live before: weights, optimizer slots, data)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if way == "keras":
        keras.mixed_precision.set_global_policy(policy)
        model = wide_mlp()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    else:
        kmp.set_policy(policy)
        model = wide_mlp()
        kmp.compile(
            model,
            optimizer=keras.optimizers.Adam(1e-3),
            loss=loss,
            fused_update=None if way == "kmp" else False,
        )
    rng = np.random.default_rng(0)
    x = rng.random((64, 2048), "float32")
    y = rng.integers(0, 10, 64)
    model.fit(x, y, batch_size=8, verbose=0)  # builds and traces
    options = tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=3, python_tracer_level=0, device_tracer_level=0
    )
    tf.profiler.experimental.start(trace_dir, options=options)
    try:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    finally:
        tf.profiler.experimental.stop()
    return live_at_peak(trace_dir)[0]


POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")

# Run in a fresh process (one for every policy: a TensorFlow start-up each
# would cost more than the measures), ops one at a time: the order in which
# the executor runs parallel ops decides which buffers are live together.
_RISES = """
import json, sys, tempfile
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
sys.path[:0] = sys.argv[1:3]  # the tests, and the source tree's root
from test_memory import POLICIES, tensors_rise
print(json.dumps({
    policy: {way: tensors_rise(way, policy, tempfile.mkdtemp())
             for way in ("keras", "kmp", "kmp-unfused")}
    for policy in POLICIES
}))
"""


@functools.cache
def _rises() -> dict:
    import pathlib

    tests = pathlib.Path(__file__).parent
    return in_fresh_process(_RISES, str(tests), str(tests.parent))


@pytest.mark.xdist_group("tensors")  # one worker measures every policy once
@pytest.mark.parametrize("policy", POLICIES)
def test_kmp_holds_no_more_tensors_than_keras_at_the_same_policy(policy):
    assert fused.resolve(None, "adam", wide_mlp().trainable_variables) == (
        fused.default_for_machine()
    )
    rises = _rises()[policy]
    keras_rise = rises["keras"]
    for way in ("kmp", "kmp-unfused"):
        rise = rises[way]
        assert rise <= 1.02 * keras_rise + MIB, (way, rise / MIB, keras_rise / MIB)
    # The measure sees the gradients (the first layer's alone are 16 MiB).
    assert keras_rise > 16 * MIB


# Run in a fresh process: what earlier tests leave in a process (grappler
# settings, oneDNN's primitive caches) moves a conv step's memory by some
# percent, and the estimate, like `kmp doctor`, is made in a process of its
# own. One process for the three models (a TensorFlow start-up each would
# cost more than their measures), the conv model first.
ESTIMATED = (("cnn", "float32"), ("mlp", "float32"), ("transformer", "mixed_bfloat16"))

_ESTIMATES_AND_FITS = """
import gc, json, sys
import keras, tensorflow as tf
import kmp
from kmp.tools import bench

def estimate_and_fit(name, policy):
    kmp.set_policy(policy)
    model, make = bench.build_model(name)
    estimate = kmp.debug.estimate_memory(model, lambda n: make(n)[0])
    x, y = make(4 * 64)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    kmp.compile(model, optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(data, verbose=0, shuffle=False)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    # Nothing of this model is left for the next one's measure to free.
    del model, data
    keras.backend.clear_session()
    gc.collect()
    return {
        "optimizer": estimate.optimizer,
        "optimizer_mb": estimate.optimizer_mb,
        "gradients_mb": estimate.gradients_mb,
        # The weights were live before fit; the optimizer's state is built
        # in it.
        "estimated_mb": estimate.total_mb(64) - estimate.weights_mb,
        "measured_mb": (peak - before) / 2**20,
    }

pairs = json.loads(sys.argv[1])
print(json.dumps({f"{n}-{p}": estimate_and_fit(n, p) for n, p in pairs}))
"""


@functools.cache
def _estimates_and_fits() -> dict:
    import json

    return in_fresh_process(_ESTIMATES_AND_FITS, json.dumps(ESTIMATED))


@pytest.mark.xdist_group("estimates")  # one worker measures the three once
@pytest.mark.parametrize("name, policy", ESTIMATED)
def test_the_memory_estimate_is_within_15_percent_of_training(name, policy):
    r = _estimates_and_fits()[f"{name}-{policy}"]
    assert r["optimizer"] == "Adam (the model has no optimizer)"
    assert r["optimizer_mb"] == pytest.approx(2 * r["gradients_mb"], rel=1e-3)
    estimated, measured = r["estimated_mb"], r["measured_mb"]
    assert abs(estimated - measured) <= 0.15 * measured, (estimated, measured)


def test_the_estimate_leaves_the_model_as_it_was():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization()]
    )
    before = [v.numpy() for v in model.variables]
    estimate = kmp.debug.estimate_memory(
        model, lambda n: np.full((n, 8), 3.0, "float32"), optimizer="sgd"
    )
    for value, variable in zip(before, model.variables, strict=True):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert estimate.optimizer == "SGD" and estimate.optimizer_mb < 0.001
    assert estimate.largest_batch(estimate.total_mb(0) - 1) == 0


def test_the_estimate_counts_the_optimizer_state_without_allocating_it(recwarn):
    # An embedding table whose Adam moments (twice the table) dwarf the
    # step's own tensors (its gradient is the batch's rows): a copy of the
    # moments built to count them would be the estimate's peak.
    rows, width = 50_000, 128
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(rows, width),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    table = rows * width * 4
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    estimate = kmp.debug.estimate_memory(model, lambda n: np.zeros((n, 4), "int32"))
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    assert estimate.optimizer == "Adam (the model has no optimizer)"
    assert estimate.optimizer_mb * MIB == pytest.approx(2 * table, rel=1e-3)
    assert peak < table / 4, peak / MIB
    assert not [w for w in recwarn if "stand-ins" in str(w.message)]


@keras.saving.register_keras_serializable(package="kmp_tests")
class _ReadsItsVariables(keras.optimizers.SGD):
    """An optimizer whose build reads its variables' values."""

    def build(self, variables):
        super().build(variables)
        self.first_values = [v.numpy() for v in variables]


def _state_bytes(optimizer, variables) -> int:
    optimizer.build(variables)
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: _ReadsItsVariables(momentum=0.9),
        # Keras's own loss-scale wrapper, whose from_config consumes the
        # config it is given (the second copy must get one of its own).
        lambda: keras.optimizers.LossScaleOptimizer(_ReadsItsVariables(momentum=0.9)),
    ],
)
def test_an_optimizer_that_cannot_count_on_stand_ins_is_counted_and_said(make):
    inputs = keras.Input((64,))
    outputs = keras.layers.Dense(32, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(outputs))
    with pytest.warns(UserWarning, match="could not be built on stand-ins"):
        estimate = kmp.debug.estimate_memory(
            model, lambda n: np.zeros((n, 64), "float32"), optimizer=make()
        )
    exact = _state_bytes(make(), model.trainable_variables)
    assert estimate.optimizer_mb * MIB == exact
    # Nothing of the attempt is left in Keras's naming of later variables.
    after = keras.layers.Dense(1, name="after")
    after.build((None, 2))
    assert after.kernel.path == "after/kernel"


def test_doctor_estimates_a_saved_models_memory_with_its_own_optimizer(
    tmp_path, capsys
):
    import json

    import kmp_cli

    model = wide_mlp()
    model.compile(optimizer=kmp.optimizers.AdamW(1e-3), loss="mse")
    path = str(tmp_path / "wide.keras")
    model.save(path)
    argv = ["doctor", "--model", path, "--policies", "float32", "--batch-size", "64"]
    assert kmp_cli.main([*argv, "--memory-budget", "1G", "--json"]) == 0
    (estimate,) = json.loads(capsys.readouterr().out)["memory_estimate"].values()
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.variables) / MIB
    assert estimate["weights_mb"] == pytest.approx(weights)
    # kmp.optimizers.AdamW: bfloat16 moments, half of Keras's AdamW.
    assert estimate["optimizer"] == "AdamW"
    assert estimate["optimizer_mb"] == pytest.approx(weights, rel=1e-3)
    total = (
        estimate["weights_mb"] + estimate["optimizer_mb"] + estimate["step_mb"]
        + 64 * estimate["per_sample_mb"]
    )  # fmt: skip
    assert estimate["total_mb"] == pytest.approx(total)
    # 1 GiB holds far more than batch 64 (no bound: the step was not seen
    # to grow with the batch, its activations being tiny beside its weights).
    assert estimate["largest_batch"] is None or estimate["largest_batch"] > 64
    assert kmp_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "memory estimate for" in out and "AdamW" in out
    assert kmp_cli.main(["doctor", "--model", str(tmp_path / "none.keras")]) != 0
    assert "existing .keras file" in capsys.readouterr().err
    assert kmp_cli.main(["doctor", "--memory-budget", "4G"]) != 0
    assert "--memory-budget only apply to a model's checks" in capsys.readouterr().err
