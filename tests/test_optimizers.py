"""kmp.optimizers: Adam and AdamW with bfloat16 moments."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from processes import in_fresh_process

import kmp


def regression_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def apply_steps(optimizer, steps=5):
    """`steps` updates of a model's variables from fixed random gradients."""
    model = regression_model()
    variables = model.trainable_variables
    optimizer.build(variables)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        optimizer.apply(
            [tf.constant(rng.normal(size=v.shape), tf.float32) for v in variables],
            variables,
        )
    return model


@pytest.mark.parametrize(
    "ours, keras_s",
    [
        (
            lambda: kmp.optimizers.Adam(1e-2, amsgrad=True, state_dtype="float32"),
            lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
        ),
        (
            lambda: kmp.optimizers.AdamW(
                1e-2, weight_decay=0.1, clipnorm=1.0, state_dtype="float32"
            ),
            lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1, clipnorm=1.0),
        ),
    ],
)
def test_float32_state_is_keras_update_exactly(ours, keras_s):
    a, b = apply_steps(ours()), apply_steps(keras_s())
    for x, y in zip(a.weights, b.weights, strict=True):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-7)
    assert not np.allclose(a.weights[0].numpy(), regression_model().weights[0])


def test_bfloat16_moments_take_half_the_memory_and_weights_stay_float32():
    def state_bytes(optimizer):
        model = regression_model()
        optimizer.build(model.trainable_variables)
        slots = optimizer.variables[2:]  # after iterations and learning rate
        assert len(slots) == 2 * len(model.trainable_variables)
        return sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in slots)

    half = state_bytes(kmp.optimizers.AdamW())
    full = state_bytes(keras.optimizers.AdamW())
    assert half == full / 2
    model = apply_steps(kmp.optimizers.AdamW(1e-2))
    assert {v.dtype for v in model.weights} == {"float32"}


def second_moment_after(steps, rounding):
    """Adam's second moment of one weight after `steps` constant gradients
    of 1 (exactly 1 - 0.999**steps in real numbers)."""
    variable = keras.Variable(np.zeros(4096, "float32"))
    optimizer = kmp.optimizers.Adam(1e-9, rounding=rounding)
    optimizer.build([variable])
    step = tf.function(lambda g: optimizer.apply([g], [variable]))
    for _ in range(steps):
        step(tf.ones(4096))
    return optimizer._velocities[0].numpy().astype("float64")


def test_stochastic_rounding_keeps_a_slow_average_that_nearest_loses():
    exact = 1 - 0.999**1500  # 0.777
    stochastic = second_moment_after(1500, "stochastic")
    nearest = second_moment_after(1500, "nearest")
    assert abs(stochastic.mean() - exact) < 0.01 * exact
    # Rounded to nearest, the average stops where its change per step falls
    # below half a bfloat16 step: far below the real value.
    assert nearest.mean() < 0.4 * exact  # 0.25: a third of the real value
    # Each weight draws its own rounding.
    assert len(np.unique(stochastic)) > 1


def test_bfloat16_moments_train_as_float32_moments_do():
    def final_loss(optimizer):
        model = regression_model()
        kmp.compile(model, optimizer=optimizer, loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(512, 16)).astype("float32")
        y = np.sin(x.sum(axis=1, keepdims=True))
        history = model.fit(x, y, batch_size=32, epochs=6, verbose=0)
        return history.history["loss"]

    float32_state = final_loss(keras.optimizers.Adam(1e-3))
    bfloat16_state = final_loss(kmp.optimizers.Adam(1e-3))
    assert float32_state[-1] < 0.8 * float32_state[0]  # it trained
    assert abs(bfloat16_state[-1] - float32_state[-1]) < 0.01 * float32_state[-1]


def test_a_saved_model_keeps_its_bfloat16_moments(tmp_path):
    kmp.set_policy("mixed_bfloat16")
    model = regression_model()
    kmp.compile(model, optimizer=kmp.optimizers.AdamW(1e-3, seed=7), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    y = x[:, :1]
    model.fit(x, y, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    inner = loaded.optimizer.inner_optimizer
    assert isinstance(inner, kmp.optimizers.AdamW)
    settings = (inner.state_dtype, inner.rounding, inner.seed)
    assert settings == ("bfloat16", "stochastic", 7)
    saved = model.optimizer.inner_optimizer.variables
    assert len(inner.variables) == len(saved)
    for a, b in zip(inner.variables, saved, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.fit(x, y, verbose=0).history["loss"][0] > 0


def test_moments_of_weights_that_are_not_float32_keep_their_dtype():
    weight = keras.Variable(np.ones(8), dtype="bfloat16")
    optimizer = kmp.optimizers.Adam(state_dtype="float32")
    optimizer.build([weight])
    assert [v.dtype for v in optimizer.variables[2:]] == ["bfloat16", "bfloat16"]
    wide = keras.Variable(np.ones(8), dtype="float64")
    optimizer = kmp.optimizers.Adam()
    optimizer.build([wide])
    assert [v.dtype for v in optimizer.variables[2:]] == ["float64", "float64"]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"state_dtype": "float16"}, ValueError, "underflows"),
        ({"rounding": "up"}, ValueError, "rounding must be one of"),
        ({"seed": "7"}, TypeError, "seed must be an integer"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        kmp.optimizers.AdamW(**kwargs)


# Run in a process of its own: a parameter-server strategy connects the
# process's eager context to its cluster for good.
_PLACEMENT = """
import json, socket
import keras, tensorflow as tf
import kmp

def address():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return f"localhost:{s.getsockname()[1]}"

spec = tf.train.ClusterSpec({"worker": [address()], "ps": [address(), address()]})
servers = [
    tf.distribute.Server(spec, job_name=job, task_index=i, start=True)
    for job, count in (("worker", 1), ("ps", 2)) for i in range(count)
]
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
strategy = tf.distribute.ParameterServerStrategy(resolver)
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)]
    )
    optimizer = kmp.optimizers.AdamW()
    optimizer.build(model.trainable_variables)
print(json.dumps({
    "weights": [v.value.device for v in model.trainable_variables],
    "momentums": [m.value.device for m in optimizer._momentums],
    "velocities": [m.value.device for m in optimizer._velocities],
}))
"""


def test_moments_are_placed_with_their_weights_under_a_parameter_server_strategy():
    placed = in_fresh_process(_PLACEMENT)
    assert len(set(placed["weights"])) == 2  # spread over both servers
    assert placed["momentums"] == placed["weights"]
    assert placed["velocities"] == placed["weights"]
