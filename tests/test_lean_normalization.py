"""kmp.layers.BatchNormalization and LayerNormalization compute what Keras's
compute and keep their 16-bit input, not a float32 copy, for the backward
pass; kmp.layers.lean(model, attention=False) puts them in place of Keras's in built
models; kmp.precision_report names the normalizations that keep a copy."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from backward import gradient_reads

import kmp
from kmp.internals import keras_private


def _pair(config=None, shape=(None, 6), seed=0, kmp_class=None):
    """kmp's normalization (`kmp.layers.BatchNormalization` by default) and
    the Keras layer it subclasses, with the same config and weights (away
    from their defaults; variances and deviations positive)."""
    kmp_class = kmp_class or kmp.layers.BatchNormalization
    config = dict(config or {})
    if issubclass(kmp_class, keras.layers.BatchNormalization):
        config = {"momentum": 0.9, **config}
    ours = kmp_class(**config)
    theirs = kmp_class.__mro__[1](**config)
    rng = np.random.default_rng(seed)
    for layer in (ours, theirs):
        layer.build(shape)
    weights = [rng.normal(1, 0.5, w.shape).astype("float32") for w in theirs.weights]
    weights = [
        np.abs(value) if "variance" in w.name or "stddev" in w.name else value
        for value, w in zip(weights, theirs.weights, strict=True)
    ]
    for layer in (ours, theirs):
        layer.set_weights(weights)
    return ours, theirs


def _run(layer, x, training):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training)
        loss = tf.reduce_sum(tf.cast(y, "float32") * np.linspace(-1, 2, y.shape[-1]))
    grads = tape.gradient(loss, [x, *layer.trainable_weights])
    return y, grads


def _assert_computes_as_keras(ours, theirs, x, training, policy):
    """Outputs and gradients (input, weights) of kmp's layer and Keras's on
    `x`: the same dtypes, values one 16-bit rounding apart at most (a few
    for gradients)."""
    y_ours, g_ours = _run(ours, x, training)
    y_theirs, g_theirs = _run(theirs, x, training)
    assert y_ours.dtype == y_theirs.dtype == x.dtype
    # One 16-bit rounding of the same float32 value apart at most.
    step = 2**-7 if policy == "mixed_bfloat16" else 2**-10
    np.testing.assert_allclose(
        tf.cast(y_ours, "float32"), tf.cast(y_theirs, "float32"), rtol=step, atol=step
    )
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert a.dtype == b.dtype
        a, b = tf.cast(a, "float32").numpy(), tf.cast(b, "float32").numpy()
        scale = max(np.abs(b).max(), 1.0)
        np.testing.assert_allclose(a, b, rtol=4 * step, atol=4 * step * scale)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("shape", [(8, 5, 5, 6), (16, 6), (4, 7, 6), (1, 6)])
@pytest.mark.parametrize("training", [True, False])
def test_it_computes_what_keras_computes_from_a_16bit_input(policy, shape, training):
    kmp.set_policy(policy)
    ours, theirs = _pair(shape=shape)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(3, 2, shape).astype("float32"))
    x = tf.cast(x, ours.compute_dtype)  # what the layer before hands on
    _assert_computes_as_keras(ours, theirs, x, training, policy)
    # The moving statistics move as Keras moves them (or stay, in inference).
    for a, b in zip(
        ours.non_trainable_weights, theirs.non_trainable_weights, strict=True
    ):
        assert np.all(np.isfinite(a.numpy()))
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_a_frozen_layer_normalizes_with_its_moving_statistics_as_keras_does():
    kmp.set_policy("mixed_bfloat16")
    ours, theirs = _pair()
    ours.trainable = theirs.trainable = False
    x = tf.cast(np.random.default_rng(2).normal(3, 2, (16, 6)), "bfloat16")
    before = [w.numpy() for w in ours.non_trainable_weights]
    np.testing.assert_allclose(
        tf.cast(ours(x, training=True), "float32"),
        tf.cast(theirs(x, training=True), "float32"),
        rtol=2**-7,
        atol=2**-7,
    )
    for a, b in zip(before, ours.non_trainable_weights, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


@pytest.mark.parametrize(
    "config, call",
    [
        ({}, {}),  # float32: nothing to save, Keras's code
        ({"renorm": True}, {}),
        ({}, {"mask": np.array([[True] * 4 + [False] * 3] * 2)}),
        ({"axis": 1}, {}),
        ({"dtype": "bfloat16"}, {}),  # weights the fused kernel does not take
    ],
    ids=["float32", "renorm", "mask", "channels-first", "bfloat16-weights"],
)
def test_where_the_fused_computation_does_not_apply_it_is_kerass(config, call):
    if config or call:
        kmp.set_policy("mixed_bfloat16")
    shape = (2, 7, 6) if config.get("axis") != 1 else (3, 2, 5)
    ours, theirs = _pair(config, shape=shape)
    x = tf.constant(np.random.default_rng(3).normal(3, 2, shape).astype("float32"))
    x = tf.cast(x, ours.compute_dtype)
    np.testing.assert_array_equal(
        ours(x, training=True, **call), theirs(x, training=True, **call)
    )
    for a, b in zip(ours.weights, theirs.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _kept_at_size(net, keras_layer, kmp_layer, x, y, elements) -> dict:
    """{'keras': dtypes, 'kmp': dtypes} of the tensors of `elements` values
    that the backward pass of `net` built with each layer reads from its
    forward pass (`gradient_reads`)."""
    kept = {}
    for name, layer in (("keras", keras_layer), ("kmp", kmp_layer)):
        reads = gradient_reads(kmp.prepare(net(layer)), x, y)
        kept[name] = {dtype for dtype, size in reads if size == elements}
    return kept


def _conv_net(batch_norm):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inputs)
    x = batch_norm(name="norm")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(x))


def test_the_backward_pass_keeps_the_16bit_input_and_no_float32_copy():
    kmp.set_policy("mixed_bfloat16")
    x = tf.constant(np.random.default_rng(4).random((4, 16, 16, 3), "float32"))
    y = tf.constant([0, 1, 2, 0])
    activation = 4 * 16 * 16 * 8  # elements of the conv's output
    kept = _kept_at_size(
        _conv_net,
        keras.layers.BatchNormalization,
        kmp.layers.BatchNormalization,
        x,
        y,
        activation,
    )
    assert kept["keras"] == {"float32", "bfloat16"}  # Keras's copy is there
    assert kept["kmp"] == {"bfloat16"}


def test_layer_normalization_recomputes_in_float32_only_once_its_gradient_arrives():
    """What the gradient recomputes from the 16-bit input depends on that
    input alone: without a dependency on the incoming gradient, the executor
    runs it during the forward pass and holds its float32 result until the
    backward pass (seen at a transformer's peak, one per layer)."""
    kmp.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 8))
    h = keras.layers.Dense(8)(inputs)
    h = kmp.layers.LayerNormalization(name="norm")(h)
    model = kmp.prepare(keras.Model(inputs, keras.layers.Dense(3)(h)))
    x = tf.constant(np.random.default_rng(5).random((4, 5, 8), "float32"))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(x, training=True), tf.float32))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(x).graph
    ops = graph.get_operations()
    # The layer's 16-bit input: what its forward pass reads under a
    # StopGradient.
    (source,) = {
        op.inputs[0].ref()
        for op in ops
        if op.type == "StopGradient" and op.inputs[0].dtype == tf.bfloat16
    }
    widened = [
        op
        for op in ops
        if op.type == "Cast"
        and op.inputs[0].ref() == source
        and op.outputs[0].dtype == tf.float32
    ]
    assert widened  # the gradient's recomputation from the 16-bit input
    for op in widened:
        assert op.control_inputs, op.name


def test_lean_normalization_replaces_every_keras_batch_normalization():
    kmp.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inner = keras.Sequential(
        [keras.layers.Dense(4), keras.layers.BatchNormalization(name="inner_norm")],
        name="block",
    )
    inputs = keras.Input((5,))
    x = keras.layers.Dense(4, name="dense")(inputs)
    x = keras.layers.BatchNormalization(name="outer_norm")(x)
    outputs = keras.layers.Dense(2, dtype="float32")(inner(x))
    model = keras.Model(inputs, outputs)
    data = np.random.default_rng(5).normal(size=(32, 5)).astype("float32")
    model(data, training=True)  # moves the moving statistics

    lean = kmp.layers.lean(model, attention=False)

    norms = [
        layer
        for layer in keras_private.sublayers(lean)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    assert sorted(n.name for n in norms) == ["inner_norm", "outer_norm"]
    assert all(type(n) is kmp.layers.BatchNormalization for n in norms)
    assert lean.get_layer("dense") is model.get_layer("dense")  # shared
    for old, new in (
        (model.get_layer("outer_norm"), lean.get_layer("outer_norm")),
        (
            inner.get_layer("inner_norm"),
            lean.get_layer("block").get_layer("inner_norm"),
        ),
    ):
        assert new is not old
        for a, b in zip(old.weights, new.weights, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(lean(data), model(data), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_lean_normalization_trains_keras_applications_under_kmp(policy):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), classes=3, alpha=0.35
    )
    count = sum(type(la) is keras.layers.BatchNormalization for la in model.layers)
    lean = kmp.layers.lean(model, attention=False)
    assert count > 10
    assert sum(type(la) is kmp.layers.BatchNormalization for la in lean.layers) == count
    # Eager steps: the same layers and dtypes as traced ones, at a fraction
    # of the cost of tracing this model (the traced step is checked above).
    kmp.compile(
        lean,
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        run_eagerly=True,
        fused_update=False,
    )
    rng = np.random.default_rng(6)
    x, y = rng.random((8, 32, 32, 3), "float32"), rng.integers(0, 3, 8)
    # Under float16 the first steps are skipped while the loss scale backs
    # off from its start (as with Keras's layers): 8 steps leave 4 to learn.
    history = lean.fit(x, y, epochs=8, batch_size=8, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_a_lean_model_saves_and_loads_with_its_layers(tmp_path):
    kmp.set_policy("mixed_bfloat16")
    lean = kmp.layers.lean(_conv_net(keras.layers.BatchNormalization), attention=False)
    x = np.random.default_rng(7).random((2, 16, 16, 3), "float32")
    lean.save(tmp_path / "lean.keras")
    loaded = keras.models.load_model(tmp_path / "lean.keras")
    assert type(loaded.get_layer("norm")) is kmp.layers.BatchNormalization
    np.testing.assert_array_equal(loaded(x), lean(x))


def test_a_model_without_batch_normalization_is_given_back_as_it_is():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert kmp.layers.lean(model, attention=False) is model


def test_a_batch_normalization_inside_a_subclassed_layer_is_named():
    kmp.set_policy("mixed_bfloat16")  # under float32 there is nothing to save

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm = keras.layers.BatchNormalization(name="hidden_norm")

        def call(self, x):
            return self.norm(x)

    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization(name="seen")(Block(name="block")(inputs))
    model = keras.Model(inputs, x)
    with pytest.warns(UserWarning, match="block/hidden_norm"):
        lean = kmp.layers.lean(model, attention=False)
    assert type(lean.get_layer("seen")) is kmp.layers.BatchNormalization


def test_bad_input_is_refused_with_the_fix():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.norm = keras.layers.BatchNormalization()

        def call(self, x):
            return self.norm(x)

    with pytest.raises(TypeError, match=r"expects a keras\.Model"):
        kmp.layers.lean(keras.layers.BatchNormalization(), attention=False)
    subclassed = Net()
    subclassed(np.zeros((2, 3), "float32"))
    with pytest.raises(
        ValueError,
        match=r"kmp\.layers\.BatchNormalization and kmp\.layers\.LayerNormalization in",
    ):
        kmp.layers.lean(subclassed, attention=False)
    unbuilt = keras.Sequential([keras.layers.BatchNormalization()])
    with pytest.raises(ValueError, match="needs a built model"):
        kmp.layers.lean(unbuilt, attention=False)


def test_a_channel_count_unknown_at_trace_time_is_computed_as_keras_does():
    kmp.set_policy("mixed_bfloat16")
    ours, theirs = _pair()
    x = tf.cast(np.random.default_rng(8).normal(3, 2, (16, 6)), "bfloat16")
    spec = [tf.TensorSpec([None, None], tf.bfloat16)]
    outputs = [
        tf.function(
            lambda x, layer=layer: layer(x, training=True), input_signature=spec
        )(x)
        for layer in (ours, theirs)
    ]
    np.testing.assert_array_equal(*outputs)


def test_models_of_other_classes_and_compiled_models_are_refused():
    class OwnSequential(keras.Sequential):
        pass

    own = OwnSequential([keras.Input((3,)), keras.layers.BatchNormalization()])
    with pytest.raises(ValueError, match="OwnSequential, which the rebuild"):
        kmp.layers.lean(own, attention=False)
    compiled = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
    kmp.compile(compiled, optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="before it is compiled"):
        kmp.layers.lean(compiled, attention=False)


def test_what_cannot_be_replaced_is_left_and_named():
    kmp.set_policy("mixed_bfloat16")  # under float32 there is nothing to save

    class OwnNorm(keras.layers.BatchNormalization):
        pass

    class OwnFunctional(keras.Model):
        pass

    inputs = keras.Input((4,))
    held = OwnFunctional(inputs, keras.layers.BatchNormalization(name="held")(inputs))
    x = OwnNorm(name="own")(inputs)
    x = keras.layers.BatchNormalization(name="seen")(held(x))
    with pytest.warns(UserWarning) as caught:
        lean = kmp.layers.lean(keras.Model(inputs, x), attention=False)
    (message,) = [
        str(w.message) for w in caught if "kmp.layers.lean left" in str(w.message)
    ]
    assert "'own' (of OwnNorm" in message and "'held' (inside" in message
    assert type(lean.get_layer("seen")) is kmp.layers.BatchNormalization
    assert type(lean.get_layer("own")) is OwnNorm
    assert lean.layers[2] is held  # kept, with its class


def test_frozen_models_stay_frozen():
    inputs = keras.Input((4,))
    base = keras.Model(inputs, keras.layers.BatchNormalization()(inputs), name="base")
    base.trainable = False
    outer_inputs = keras.Input((4,))
    outer = keras.Model(outer_inputs, keras.layers.Dense(2)(base(outer_inputs)))
    lean = kmp.layers.lean(outer, attention=False)
    rebuilt = lean.get_layer("base")
    assert rebuilt is not base and not rebuilt.trainable
    assert len(lean.trainable_weights) == 2  # the head's kernel and bias
    frozen = keras.Model(outer_inputs, base(outer_inputs))
    frozen.trainable = False
    assert not kmp.layers.lean(frozen, attention=False).trainable


def test_the_precision_report_says_where_a_float32_copy_is_kept():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(_conv_net(keras.layers.BatchNormalization))
    report = kmp.precision_report(model, trace=False)
    assert "1 normalization layer ('norm') keeps a float32 copy" in report.memory
    assert "kmp.layers.lean(model)" in str(report)
    lean = kmp.prepare(kmp.layers.lean(model, attention=False))
    assert kmp.precision_report(lean, trace=False).memory == ""
    kmp.compile(model, optimizer="sgd", loss="mse", jit_compile=True)
    assert kmp.precision_report(model, trace=False).memory == ""  # XLA decides
    kmp.set_policy("float32")
    assert kmp.precision_report(_conv_net(keras.layers.BatchNormalization)).memory == ""


# --- LayerNormalization ------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize(
    "shape, config",
    [
        ((8, 6), {}),
        ((4, 5, 6), {}),
        ((2, 3, 4, 6), {"axis": 3}),
        ((4, 5, 6), {"center": False, "scale": False}),
    ],
    ids=["rank-2", "rank-3", "rank-4-axis-3", "no-center-no-scale"],
)
def test_layer_normalization_computes_what_keras_computes(policy, shape, config):
    kmp.set_policy(policy)
    ours, theirs = _pair(
        config, shape=shape, seed=9, kmp_class=kmp.layers.LayerNormalization
    )
    x = tf.constant(np.random.default_rng(10).normal(3, 2, shape).astype("float32"))
    x = tf.cast(x, ours.compute_dtype)
    _assert_computes_as_keras(ours, theirs, x, True, policy)


@pytest.mark.parametrize(
    "config, shape",
    [
        ({"rms_scaling": True}, (4, 6)),
        ({"axis": [1, 2]}, (2, 3, 6)),
        ({"dtype": "bfloat16"}, (4, 6)),
        ({}, (4, 6)),  # float32
    ],
    ids=["rms", "two-axes", "bfloat16-weights", "float32"],
)
def test_where_kmps_layer_normalization_does_not_apply_it_is_kerass(config, shape):
    if config:
        kmp.set_policy("mixed_bfloat16")
    ours, theirs = _pair(
        config, shape=shape, seed=9, kmp_class=kmp.layers.LayerNormalization
    )
    x = tf.constant(np.random.default_rng(11).normal(3, 2, shape).astype("float32"))
    x = tf.cast(x, ours.compute_dtype)
    np.testing.assert_array_equal(ours(x), theirs(x))


def _token_net(layer_norm):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,), dtype="int32")
    x = keras.layers.Embedding(50, 32)(inputs)
    x = x + keras.layers.Dense(32, name="mix")(x)  # an operation, not a layer
    x = layer_norm(name="norm")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(x))


def test_layer_normalization_backward_keeps_the_16bit_input_and_no_float32_copy():
    kmp.set_policy("mixed_bfloat16")
    x = tf.constant(np.random.default_rng(13).integers(0, 50, (4, 16)), "int32")
    y = tf.constant([0, 1, 2, 0])
    activation = 4 * 16 * 32
    kept = _kept_at_size(
        _token_net,
        keras.layers.LayerNormalization,
        kmp.layers.LayerNormalization,
        x,
        y,
        activation,
    )
    assert "float32" in kept["keras"]  # Keras's copy is there
    assert kept["kmp"] == {"bfloat16"}


def test_lean_normalization_replaces_layer_normalization_and_trains():
    kmp.set_policy("mixed_bfloat16")
    model = _token_net(keras.layers.LayerNormalization)
    report = kmp.precision_report(kmp.prepare(model), trace=False)
    assert "1 normalization layer ('norm')" in report.memory
    lean = kmp.layers.lean(model, attention=False)
    assert type(lean.get_layer("norm")) is kmp.layers.LayerNormalization
    assert kmp.precision_report(lean, trace=False).memory == ""
    kmp.compile(
        lean,
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
    )
    rng = np.random.default_rng(14)
    x, y = rng.integers(0, 50, (32, 16)).astype("int32"), rng.integers(0, 3, 32)
    losses = lean.fit(x, y, epochs=4, batch_size=16, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_layer_normalization_second_derivatives_are_kerass():
    # A gradient penalty (WGAN-GP) differentiates the input's gradient, here
    # through the normalization's statistics into the layer before it.
    kmp.set_policy("mixed_bfloat16")
    x = tf.constant(np.random.default_rng(15).normal(3, 2, (8, 6)), "float32")
    weights = np.linspace(-1, 2, 6).astype("float32")

    def net(norm):
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(6), norm()])

    @tf.function
    def penalty_gradients(model, x):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(tf.cast(model(x), "float32") ** 2 * weights)
            penalty = tf.reduce_sum(inner.gradient(y, x) ** 2)
        return outer.gradient(penalty, model.trainable_weights)

    ours = penalty_gradients(net(kmp.layers.LayerNormalization), x)
    theirs = penalty_gradients(net(keras.layers.LayerNormalization), x)
    for a, b in zip(ours, theirs, strict=True):
        b = b.numpy()
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * np.abs(b).max())


def test_layer_normalization_keeps_no_float32_copy_on_an_eager_tape():
    kmp.set_policy("mixed_bfloat16")
    x = tf.cast(np.random.default_rng(16).normal(size=(8, 128, 256)), "bfloat16")
    held = {}
    for name, layer_class in (
        ("keras", keras.layers.LayerNormalization),
        ("kmp", kmp.layers.LayerNormalization),
    ):
        layers = [layer_class() for _ in range(4)]
        y = x
        for layer in layers:  # built outside the measure
            y = layer(y)
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for layer in layers:
                y = layer(y)
            held[name] = tf.config.experimental.get_memory_info("CPU:0")["current"]
            held[name] -= before
        del tape, y
    # Four float32 copies of the input are 16 MiB; Keras's tape holds more.
    assert held["keras"] > 16 * 2**20
    assert held["kmp"] < held["keras"] / 4


def test_the_report_names_a_layer_normalization_by_the_dtype_it_gets():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(
        keras.Sequential(
            [
                keras.Input((16, 8)),
                keras.layers.LayerNormalization(name="gets_float32"),
                keras.layers.Dense(4),
                keras.layers.LayerNormalization(axis=2, name="last_by_number"),
                keras.layers.LayerNormalization(name="float32_policy", dtype="float32"),
                keras.layers.Dense(3),
            ]
        )
    )
    memory = kmp.precision_report(model, trace=False).memory
    assert "2 normalization layers ('last_by_number', 'float32_policy')" in memory


def test_nothing_is_named_where_a_float32_policy_leaves_nothing_to_save():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            return self.norm(x)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, Block()(keras.layers.LayerNormalization()(inputs)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lean = kmp.layers.lean(model, attention=False)
    assert lean is not model
