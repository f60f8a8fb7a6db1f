"""kmp.layers.MultiHeadAttention computes what Keras's computes and keeps its
16-bit attention probabilities, not a float32 copy of them, for the backward
pass; kmp.layers.lean puts it in place of Keras's in built models."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from backward import gradient_reads
from tolerances import RELATIVE
from tolerances import relative_error

import kmp
from kmp.internals import keras_private
from kmp.precision import quantization

# One 16-bit rounding of a value of magnitude one.
STEP = {"mixed_bfloat16": 2**-7, "mixed_float16": 2**-10, "float32": 2**-23}


def _pair(policy, value_length=5, key_width=False, **config):
    """kmp's attention and Keras's, built for queries of length 6 and values
    of `value_length` (16 features each; keys of 12 where `key_width`), with
    the same config and weights."""
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    ours = kmp.layers.MultiHeadAttention(num_heads=4, key_dim=6, **config)
    theirs = keras.layers.MultiHeadAttention(num_heads=4, key_dim=6, **config)
    key_shape = (2, value_length, 12) if key_width else None
    for layer in (ours, theirs):
        layer.build((2, 6, 16), (2, value_length, 16), key_shape)
    theirs.set_weights(ours.get_weights())
    return ours, theirs


def _inputs(value_length=5, seed=0):
    rng = np.random.default_rng(seed)
    query = tf.constant(rng.normal(size=(2, 6, 16)).astype("float32"))
    value = tf.constant(rng.normal(size=(2, value_length, 16)).astype("float32"))
    return query, value


def _run(layer, query, value, **call):
    """The layer's output (and scores, where asked for) and the gradients of
    a weighted sum of the output: query, value, then the layer's weights."""
    with tf.GradientTape() as tape:
        tape.watch([query, value])
        result = layer(query, value, **call)
        output = result[0] if isinstance(result, tuple) else result
        loss = tf.reduce_sum(tf.cast(output, "float32") * np.linspace(-1, 2, 16))
    return result, tape.gradient(loss, [query, value, *layer.trainable_weights])


def _masks(kind, value_length):
    if kind == "none":
        return {}
    if kind == "causal":
        return {"use_causal_mask": True}
    if kind == "attention_mask":
        mask = np.ones((2, 6, value_length), bool)
        mask[0, :, 3:] = False  # padding
        mask[1, 2, :] = False  # a query that may attend to nothing
        return {"attention_mask": tf.constant(mask)}
    if kind == "key":  # a key of its own, of another width
        key = np.random.default_rng(7).normal(size=(2, value_length, 12))
        return {"key": tf.constant(key.astype("float32"))}
    value_mask = np.ones((2, value_length), bool)
    value_mask[1, 2:] = False
    return {"value_mask": tf.constant(value_mask)}


def _assert_gradients_close(ours, theirs, policy, factor=4):
    step = STEP[policy]
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype
        a, b = tf.cast(a, "float32").numpy(), tf.cast(b, "float32").numpy()
        scale = max(np.abs(b).max(), 1.0)
        np.testing.assert_allclose(a, b, rtol=0, atol=factor * step * scale)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize(
    "masks", ["none", "causal", "attention_mask", "value_mask", "key"]
)
def test_it_computes_what_keras_computes(policy, masks):
    length = 6 if masks == "causal" else 5
    ours, theirs = _pair(policy, value_length=length, key_width=masks == "key")
    query, value = _inputs(length)
    call = _masks(masks, length)
    y_ours, g_ours = _run(ours, query, value, **call)
    y_theirs, g_theirs = _run(theirs, query, value, **call)
    assert y_ours.dtype == y_theirs.dtype == ours.compute_dtype
    # The same operations in the same order: the same values.
    np.testing.assert_array_equal(y_ours, y_theirs)
    # The softmax's gradient reads the probabilities rounded to 16 bits.
    _assert_gradients_close(g_ours, g_theirs, policy)


def _assert_runs_alike(ours, theirs, query, value, call):
    """The same outputs (and scores) and gradients, bit for bit."""
    (y_ours, g_ours), (y_theirs, g_theirs) = (
        _run(layer, query, value, **call) for layer in (ours, theirs)
    )
    for a, b in zip(tf.nest.flatten(y_ours), tf.nest.flatten(y_theirs), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(g_ours, g_theirs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "policy, config, call",
    [
        ("float32", {}, {}),
        ("mixed_bfloat16", {"dropout": 0.5}, {"training": False}),
        ("mixed_bfloat16", {}, {"return_attention_scores": True}),
        (
            "mixed_float16",
            {},
            {"use_causal_mask": True, "return_attention_scores": True},
        ),
    ],
    ids=["float32", "dropout", "scores", "scores-causal"],
)
def test_where_it_computes_another_way_it_is_kerass(policy, config, call):
    length = 6 if call.get("use_causal_mask") else 5
    ours, theirs = _pair(policy, value_length=length, **config)
    query, value = _inputs(length)
    _assert_runs_alike(ours, theirs, query, value, call)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_it_differentiates_a_second_time(policy):
    """A gradient penalty differentiates the gradient, which reads the
    forward pass's probabilities: through them, it differentiates the
    softmax again. Against the same layer computed in float32."""
    query, value = _inputs()

    def penalty_gradients(layer):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(query)
                output = tf.cast(layer(query, value), "float32")
                loss = tf.reduce_sum(output * np.linspace(-1, 2, 16))
            penalty = tf.reduce_sum(inner.gradient(loss, query) ** 2)
        gradients = outer.gradient(penalty, layer.trainable_weights)
        return np.concatenate(
            [
                np.zeros(w.shape).ravel() if g is None else np.ravel(g)
                for g, w in zip(gradients, layer.trainable_weights, strict=True)
            ]
        )

    ours, _ = _pair(policy)
    reference, _ = _pair("float32")
    reference.set_weights(ours.get_weights())
    expected = penalty_gradients(reference)
    dtype = policy.removeprefix("mixed_")
    assert relative_error(penalty_gradients(ours), expected) < RELATIVE[dtype]


def _token_net(attention):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(50, 16)(tokens)
    x = attention(num_heads=4, key_dim=6, name="attention")(x, x, use_causal_mask=True)
    return keras.Model(tokens, keras.layers.Dense(5, dtype="float32")(x))


def test_the_backward_pass_keeps_16bit_probabilities_and_no_float32_copy():
    kmp.set_policy("mixed_bfloat16")
    x = tf.constant(np.random.default_rng(1).integers(0, 50, (2, 8)), "int32")
    y = tf.constant(np.random.default_rng(2).integers(0, 5, (2, 8)), "int32")
    probabilities = 2 * 4 * 8 * 8  # batch, heads, queries, keys
    kept = {}
    for name, attention in (
        ("keras", keras.layers.MultiHeadAttention),
        ("kmp", kmp.layers.MultiHeadAttention),
    ):
        reads = gradient_reads(kmp.prepare(_token_net(attention)), x, y)
        kept[name] = {
            dtype for dtype, size in reads if size == probabilities and dtype != "bool"
        }
    assert kept["keras"] == {"float32", "bfloat16"}  # Keras's copy is there
    assert kept["kmp"] == {"bfloat16"}


def test_the_gradient_widens_the_probabilities_only_once_it_arrives():
    """The float32 copy the gradient makes of the 16-bit probabilities
    depends on them alone: without a dependency on the incoming gradient,
    the executor makes it during the forward pass and holds it until the
    backward pass, which is what the layer is there to avoid."""
    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(_token_net(kmp.layers.MultiHeadAttention))
    x = tf.constant(np.random.default_rng(3).integers(0, 50, (2, 8)), "int32")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(x, training=True), tf.float32))
        return tape.gradient(loss, model.trainable_variables)

    ops = step.get_concrete_function(x).graph.get_operations()
    widened = [
        op
        for op in ops
        if op.type == "Cast"
        and op.inputs[0].dtype == tf.bfloat16
        and op.outputs[0].dtype == tf.float32
        and op.inputs[0].shape.as_list() == [2, 4, 8, 8]
        and op.inputs[0].op.type == "IdentityN"  # the probabilities returned
    ]
    assert widened
    for op in widened:
        assert op.control_inputs, op.name


def test_under_float16_kmp_computes_its_scores_in_float32_as_for_kerass():
    """kmp's attention scores rule (float32 query and key projections under
    float16) applies to kmp's layer as to Keras's, and the layer then
    computes as Keras's does."""
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(_token_net(kmp.layers.MultiHeadAttention))
    attention = model.get_layer("attention")
    assert attention.query_dense.compute_dtype == "float32"
    assert attention.key_dense.compute_dtype == "float32"
    assert attention.value_dense.compute_dtype == "float16"
    reference = kmp.prepare(_token_net(keras.layers.MultiHeadAttention))
    x = np.random.default_rng(4).integers(0, 50, (2, 8)).astype("int32")
    np.testing.assert_array_equal(model(x), reference(x))


def test_compiled_by_xla_it_computes_what_keras_computes():
    ours, theirs = _pair("mixed_bfloat16", value_length=6)
    query, value = _inputs(6)

    def compiled(layer):
        return tf.function(
            lambda q, v: layer(q, v, use_causal_mask=True), jit_compile=True
        )

    np.testing.assert_array_equal(
        compiled(ours)(query, value), compiled(theirs)(query, value)
    )


def _transformer(attention=keras.layers.MultiHeadAttention):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(50, 16, mask_zero=True)(tokens)
    h = keras.layers.LayerNormalization(name="norm")(x)
    h = attention(num_heads=4, key_dim=4, name="attention")(h, h, use_causal_mask=True)
    x = keras.layers.Add()([x, h])
    outputs = keras.layers.Dense(50, dtype="float32", name="logits")(x)
    return keras.Model(tokens, outputs)


def test_lean_replaces_attention_and_normalization_and_trains():
    kmp.set_policy("mixed_bfloat16")
    model = _transformer()
    lean = kmp.layers.lean(model)
    assert type(lean.get_layer("attention")) is kmp.layers.MultiHeadAttention
    assert type(lean.get_layer("norm")) is kmp.layers.LayerNormalization
    for a, b in zip(model.weights, lean.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x = np.random.default_rng(5).integers(0, 50, (16, 8)).astype("int32")
    x[:, 6:] = 0  # padding, masked through Embedding's mask
    np.testing.assert_allclose(lean(x), model(x), rtol=0.05, atol=0.05)
    kmp.compile(
        lean,
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = lean.fit(x, np.roll(x, -1, axis=1), epochs=3, batch_size=8, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_lean_after_prepare_keeps_the_policies_kmp_set():
    """A model prepared (by kmp.prepare or kmp.compile) and then made lean:
    the rebuilt attention keeps kmp's float32 query and key projections
    under float16 and its 16-bit value and output projections (a layer's
    config carries its own policy alone), and computes as before."""
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(_transformer())
    before = {
        layer.path: quantization.float_part(layer)
        for layer in keras_private.sublayers(
            model.get_layer("attention"), include_self=True
        )
    }
    assert before["attention/value"] == "mixed_float16"
    assert before["attention/query"] == "float32"
    x = np.random.default_rng(7).integers(1, 50, (2, 8)).astype("int32")
    expected = model(x)
    lean = kmp.prepare(kmp.layers.lean(model))
    after = {
        layer.path: quantization.float_part(layer)
        for layer in keras_private.sublayers(
            lean.get_layer("attention"), include_self=True
        )
    }
    assert after == before
    np.testing.assert_allclose(lean(x), expected, rtol=0.01, atol=0.01)


def test_lean_normalization_leaves_attention_as_it_is():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.layers.lean(_transformer(), attention=False)
    assert type(model.get_layer("attention")) is keras.layers.MultiHeadAttention
    assert type(model.get_layer("norm")) is kmp.layers.LayerNormalization


def test_lean_names_the_attention_it_cannot_replace():
    class Attention(keras.layers.MultiHeadAttention):
        """A subclass: its code is the user's."""

    kmp.set_policy("mixed_bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = kmp.layers.lean(_transformer(Attention))
    (message,) = [str(w.message) for w in caught if "kmp.layers.lean" in str(w.message)]
    assert "'attention'" in message and "kmp.layers.MultiHeadAttention" in message
    assert type(model.get_layer("attention")) is Attention
    assert type(model.get_layer("norm")) is kmp.layers.LayerNormalization
    # The report's advice for it is kmp's layer as its base class.
    memory = kmp.precision_report(kmp.prepare(model), trace=False).memory
    assert "1 attention layer ('attention')" in memory and "base class" in memory


def test_a_model_saved_with_it_loads_with_it(tmp_path):
    kmp.set_policy("mixed_bfloat16")
    model = kmp.layers.lean(_transformer())
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.get_layer("attention")) is kmp.layers.MultiHeadAttention
    x = np.random.default_rng(6).integers(1, 50, (2, 8)).astype("int32")
    np.testing.assert_array_equal(loaded(x), model(x))


def test_the_report_names_the_attention_that_keeps_a_float32_copy():
    kmp.set_policy("mixed_bfloat16")
    model = kmp.prepare(_transformer())
    memory = kmp.precision_report(model, trace=False).memory
    assert "1 attention layer ('attention') keeps a float32 copy" in memory
    assert "kmp.layers.lean(model)" in memory
    lean = kmp.prepare(kmp.layers.lean(_transformer()))
    assert kmp.precision_report(lean, trace=False).memory == ""


@pytest.mark.parametrize(
    "policy, config",
    [
        ("float32", {}),
        ("mixed_float16", {}),  # kmp's float32 scores: float32 probabilities
        ("mixed_bfloat16", {"dropout": 0.1}),  # Keras's own 16-bit softmax
    ],
    ids=["float32", "float16-float32-scores", "dropout"],
)
def test_the_report_is_silent_where_kerass_attention_keeps_no_copy(policy, config):
    kmp.set_policy(policy)

    def attention(**kwargs):
        return keras.layers.MultiHeadAttention(**kwargs, **config)

    model = kmp.layers.lean(_transformer(attention), attention=False)
    # Before kmp's rules apply (under float16 they move the scores to
    # float32) and after.
    assert "attention" not in kmp.precision_report(model, trace=False).memory
    kmp.prepare(model)
    assert "attention" not in kmp.precision_report(model, trace=False).memory


# --- GroupQueryAttention -----------------------------------------------------


def _group_pair(policy, **config):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    layers = [
        cls(head_dim=6, num_query_heads=4, num_key_value_heads=2, **config)
        for cls in (kmp.layers.GroupQueryAttention, keras.layers.GroupQueryAttention)
    ]
    for layer in layers:
        layer.build((2, 6, 16), (2, 6, 16))
    layers[1].set_weights(layers[0].get_weights())
    return layers


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("masks", ["none", "causal", "attention_mask"])
def test_group_query_attention_computes_what_keras_computes(policy, masks):
    ours, theirs = _group_pair(policy)
    query, value = _inputs(6)
    call = _masks(masks, 6)
    y_ours, g_ours = _run(ours, query, value, **call)
    y_theirs, g_theirs = _run(theirs, query, value, **call)
    assert y_ours.dtype == ours.compute_dtype
    np.testing.assert_array_equal(y_ours, y_theirs)
    _assert_gradients_close(g_ours, g_theirs, policy)


@pytest.mark.parametrize(
    "config, call",
    [({"dropout": 0.5}, {"training": False}), ({}, {"return_attention_scores": True})],
    ids=["dropout", "scores"],
)
def test_group_query_attention_is_kerass_where_keras_computes_another_way(config, call):
    ours, theirs = _group_pair("mixed_bfloat16", **config)
    query, value = _inputs(6)
    _assert_runs_alike(ours, theirs, query, value, call)


def _grouped_net(attention):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(50, 16)(tokens)
    x = attention(head_dim=6, num_query_heads=4, num_key_value_heads=2, name="gqa")(
        x, x, use_causal_mask=True
    )
    return keras.Model(tokens, keras.layers.Dense(5, dtype="float32")(x))


def test_group_query_attention_keeps_16bit_probabilities_and_is_put_in_by_lean():
    kmp.set_policy("mixed_bfloat16")
    x = tf.constant(np.random.default_rng(8).integers(0, 50, (2, 8)), "int32")
    y = tf.constant(np.random.default_rng(9).integers(0, 5, (2, 8)), "int32")
    probabilities = 2 * 4 * 8 * 8
    model = _grouped_net(keras.layers.GroupQueryAttention)
    memory = kmp.precision_report(kmp.prepare(model), trace=False).memory
    assert "1 attention layer ('gqa') keeps a float32 copy" in memory
    lean = kmp.layers.lean(model)
    assert type(lean.get_layer("gqa")) is kmp.layers.GroupQueryAttention
    assert kmp.precision_report(kmp.prepare(lean), trace=False).memory == ""
    kept = {}
    for name, net in (("keras", model), ("kmp", lean)):
        reads = gradient_reads(kmp.prepare(net), x, y)
        kept[name] = {
            dtype for dtype, size in reads if size == probabilities and dtype != "bool"
        }
    assert kept["keras"] == {"float32", "bfloat16"}
    assert kept["kmp"] == {"bfloat16"}


def test_under_float16_kmp_computes_grouped_scores_in_float32_as_for_kerass():
    kmp.set_policy("mixed_float16")
    model = kmp.prepare(_grouped_net(kmp.layers.GroupQueryAttention))
    reference = kmp.prepare(_grouped_net(keras.layers.GroupQueryAttention))
    dtypes, expected = (
        [inner.compute_dtype for inner in keras_private.sublayers(m.get_layer("gqa"))]
        for m in (model, reference)
    )
    assert dtypes == expected and dtypes[0] == "float32"  # the query projection
    x = np.random.default_rng(10).integers(0, 50, (2, 8)).astype("int32")
    np.testing.assert_array_equal(model(x), reference(x))


def test_the_reports_attention_note_reads_the_policies_rules_give_the_projections():
    # A rule that moves the query projection alone to float32: no 16-bit
    # logits, before the rule applies and after.
    kmp.set_policy("mixed_bfloat16")
    kmp.set_layer_policy("name:query", "float32")
    model = _transformer()
    assert "attention" not in kmp.precision_report(model, trace=False).memory
    kmp.prepare(model)
    assert model.get_layer("attention").query_dense.compute_dtype == "float32"
    assert "attention" not in kmp.precision_report(model, trace=False).memory
