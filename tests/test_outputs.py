"""A model's outputs cast to float32 where they are handed on: `predict`
casts them (kmp.backend.outputs), Keras's losses cast them, and the layer
that produces them keeps its policy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.planning import decisions as planning

MIXED = ["mixed_float16", "mixed_bfloat16"]
COMPUTE = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
# predict's graph and the eager call may round a 16-bit matmul differently
# (fused kernels, XLA): values agree to one bfloat16 step.
ONE_STEP = {"rtol": 2**-7, "atol": 1e-6}


def two_outputs():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    value = keras.layers.Dense(3, name="value")(h)
    label = keras.ops.argmax(value, axis=-1)  # an int output: left as it is
    return keras.Model(inputs, {"value": value, "label": label})


@pytest.mark.parametrize("policy", MIXED)
def test_predict_casts_16bit_outputs_and_leaves_the_others(policy):
    kmp.set_policy(policy)
    model = kmp.prepare(two_outputs())
    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    direct = model(x)
    assert keras.backend.standardize_dtype(direct["value"].dtype) == COMPUTE[policy]
    want = np.asarray(keras.ops.cast(direct["value"], "float32"))
    predicted = model.predict(x, batch_size=4, verbose=0)
    # The cast is traced with Keras's function: no op outside the graph
    # (traced twice: the full batches, then the last one of 2).
    assert model.predict_function._function.experimental_get_tracing_count() == 2
    for got in (predicted, model.predict_on_batch(x)):
        assert got["value"].dtype == np.float32
        np.testing.assert_allclose(got["value"], want, **ONE_STEP)  # the cast
        assert got["label"].dtype == np.asarray(direct["label"]).dtype


@pytest.mark.parametrize(
    "options",
    [{"run_eagerly": True}, {"steps_per_execution": 2}, {"jit_compile": True}],
    ids=["eager", "steps_per_execution", "xla"],
)
def test_predict_casts_however_keras_runs_it(options):
    kmp.set_policy("mixed_bfloat16")
    model = two_outputs()
    kmp.compile(model, optimizer="sgd", loss={"value": "mse"}, **options)
    x = np.ones((8, 4), "float32")
    got = model.predict(x, batch_size=2, verbose=0)
    assert got["value"].dtype == np.float32
    want = np.asarray(keras.ops.cast(model(x)["value"], "float32"))
    np.testing.assert_allclose(got["value"], want, **ONE_STEP)


def test_keras_compile_after_prepare_and_attach_keeps_the_cast():
    # The path without kmp.compile: prepare, Keras's own compile, attach.
    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(two_outputs())
    model.compile(optimizer="sgd", loss={"value": "mse"})  # Keras drops it
    assert model.predict(np.ones((2, 4)), verbose=0)["value"].dtype != np.float32
    kmp.telemetry.attach(model)
    assert model.predict(np.ones((2, 4)), verbose=0)["value"].dtype == np.float32


@pytest.mark.parametrize("policy", MIXED)
def test_the_loss_receives_the_output_cast_and_trains_like_a_float32_head(policy):
    # The head computes in the policy; Keras's loss casts its output. The
    # same model with a float32 head (what kmp did before) ends close.
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    losses = {}
    for head in (None, "float32"):
        kmp.set_policy(policy)
        if head:
            kmp.set_layer_policy("name:value", head)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        h = keras.layers.Dense(16, name="hidden")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="value")(h))
        kmp.compile(model, optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        kmp.clear_layer_policies()
        assert model.get_layer("value").compute_dtype == (head or COMPUTE[policy])
        history = model.fit(x, y, batch_size=16, epochs=20, verbose=0)
        losses[head] = min(history.history["loss"][-3:])
    # Both fit the linear targets (variance 14.5) to about 1e-3 (measured on
    # an Intel Xeon: 0.0016 and 0.0016 under float16, 0.0012 and 0.0012
    # under bfloat16, cast and float32 head).
    assert losses[None] < 1e-3 * float(y.var())
    assert losses[None] < 4 * losses["float32"] + 2e-3


class ReturnsHeld(keras.Model):
    """A subclassed model whose call returns a model it holds: Keras's loss
    takes that output, as it takes a Functional model's."""

    def __init__(self):
        super().__init__()
        inputs = keras.Input((4,))
        self.body = keras.Model(inputs, keras.layers.Dense(2, name="out")(inputs))

    def call(self, x):
        return self.body(x)


def test_a_model_a_subclassed_call_returns_has_its_output_cast():
    kmp.set_policy("mixed_bfloat16")
    model = ReturnsHeld()
    model(np.ones((2, 4)))
    kmp.prepare(model)
    decision = planning.plan(model).decision(f"{model.body.name}/out")
    assert (decision.rule, decision.policy.name) == (planning.OUTPUT, "mixed_bfloat16")
    assert model.predict(np.ones((2, 4)), verbose=0).dtype == np.float32


def test_a_softmax_output_a_subclassed_call_mixes_keeps_its_dtype():
    # Keras's softmax rule would make the output layer float32; the call
    # adds it to a 16-bit tensor in raw TensorFlow, so it keeps its policy.
    class Mixes(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(3)
            self.head = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            h = self.hidden(x)
            p = self.head(h)
            _ = tf.subtract(p, h)  # raw TensorFlow: fails on mixed dtypes
            return p

    kmp.set_policy("mixed_bfloat16")
    model = Mixes()
    model(np.ones((2, 4)))
    kmp.compile(model, optimizer="sgd", loss="mse")
    assert model.head.compute_dtype == "bfloat16"
    decision = planning.plan(model).decision(model.head.name)
    assert "would meet a 16-bit tensor" in decision.note
    history = model.fit(np.ones((4, 4)), np.ones((4, 3)), verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_an_output_layer_whose_output_also_feeds_an_op_is_not_named():
    # Its output also feeds an op that does not absorb a dtype change; its
    # output to the loss is cast either way, and the layer keeps its policy.
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    out = keras.layers.Dense(4, name="shared")(inputs)
    updated = keras.ops.slice_update(out, (0, 0), keras.ops.ones((1, 2), out.dtype))
    model = keras.Model(inputs, [out, keras.layers.Dense(2)(updated)])
    kmp.prepare(model)
    assert planning.plan(model).decision("shared").rule == planning.OUTPUT
    assert "16-bit output" not in kmp.debug.precision_audit(model).kinds()


def test_a_retrace_drops_the_traced_predict_of_the_models_inside():
    # The healer moves a layer and has the step traced again: a model
    # inside whose own predict ran before must not keep the old policies.
    from kmp.training import train_function

    kmp.set_policy("mixed_float16")
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inner(inputs)))
    kmp.compile(model, optimizer="sgd", loss="mse")
    x = np.ones((2, 4), "float32")
    assert inner.predict(x, verbose=0).dtype == np.float16  # Keras's, traced
    inner.get_layer("d").dtype_policy = "float32"  # as OverflowHealer moves it
    train_function.retrace(model)
    assert inner.predict(x, verbose=0).dtype == np.float32
