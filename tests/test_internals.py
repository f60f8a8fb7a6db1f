"""Every private attribute of Keras, KerasHub and TensorFlow kmp reads is
still there in the installed versions (`kmp.internals`), and an accessor
fails closed where one is not."""

import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmp.internals import autograph
from kmp.internals import changed
from kmp.internals import keras_hub_names
from kmp.internals import keras_private
from kmp.internals import tensorflow_private


def _functional():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))


def test_every_keras_attribute_kmp_reads_is_there():
    model = _functional()
    assert [layer.name for layer in keras_private.sublayers(model)][-2:] == [
        "hidden",
        "head",
    ]
    assert keras_private.converts_input_args(model.get_layer("head")) is True
    nodes = keras_private.graph_nodes(model)
    assert nodes and all(isinstance(depth, int) for depth in nodes)
    assert keras_private.producer(model.outputs[0]) is model.get_layer("head")
    assert keras_private.inbound_nodes(model.get_layer("head"))
    with keras_private.tracker_unlocked(model):
        model.kmp_probe = 1
    for base in (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention):
        assert keras_private.runs_attention_code_of(base.__new__(base), base)

    class OwnScores(keras.layers.MultiHeadAttention):
        def _compute_attention(self, *args, **kwargs):
            return super()._compute_attention(*args, **kwargs)

    layer = OwnScores(2, 4)
    assert not keras_private.runs_attention_code_of(
        layer, keras.layers.MultiHeadAttention
    )
    assert keras_private.flash_attention(layer) is False
    assert keras_private.flash_attention(OwnScores(2, 4, flash_attention=True))
    grouped = keras.layers.GroupQueryAttention(4, 2, 1)
    assert keras_private.returns_attention_scores(grouped) is False

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    built = Subclassed()
    built(np.ones((2, 3), "float32"))
    assert keras_private.build_shapes(built) == {"input_shape": (2, 3)}
    assert keras_private.build_shapes(Subclassed()) == {}
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    assert len(keras_private.optimizer_variables(optimizer)) == 4
    variable = model.get_layer("head").kernel
    assert keras_private.backing_variable(variable) is not variable
    stand_in = keras_private.with_path(keras.Variable(np.zeros(2)), "a b/c/kernel")
    assert stand_in.path == "a b/c/kernel"
    # In a graph TensorFlow refuses a scope name Keras has already pushed.
    with (
        tf.Graph().as_default(),
        keras_private.name_scopes_restored(),
        pytest.raises(ValueError, match="not a valid"),
    ):
        keras.name_scope("_refused").__enter__()
    assert keras.Variable(np.zeros(2), name="after").path == "after"
    assert keras_private.is_plain_graph_model(model)
    assert keras_private.is_plain_graph_model(keras.Sequential([keras.Input((1,))]))
    assert not keras_private.is_plain_graph_model(Subclassed())
    keras_private.set_own_trainable(model, False)
    assert not model.trainable and model.get_layer("head").trainable


def test_a_model_that_is_not_a_graph_is_told_apart_from_a_changed_keras():
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert keras_private.graph_nodes(Subclassed()) is None


def test_a_missing_keras_attribute_is_an_error_that_names_it():
    class Bare:
        pass

    with pytest.raises(changed.InternalsChanged, match="_convert_input_args"):
        keras_private.converts_input_args(Bare())
    with pytest.raises(changed.InternalsChanged, match="_flatten_layers"):
        keras_private.sublayers(Bare())


def test_every_keras_hub_class_kmp_has_a_rule_for_resolves_in_the_installed_keras_hub():
    pytest.importorskip("keras_hub")
    for name in keras_hub_names.all_names():
        module, _, cls = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name
    assert keras_hub_names.check_installed() == ()


def test_a_keras_hub_class_that_moved_is_warned_about(monkeypatch):
    import kmp
    from kmp.precision import kinds

    monkeypatch.setattr(keras_hub_names, "check_installed", lambda: ("x.Moved",))
    monkeypatch.setattr(kinds, "_said_unresolved", set())
    pytest.importorskip("keras_hub")
    with pytest.warns(UserWarning, match="no longer defines.*x.Moved"):
        kmp.planning.decisions.plan(_functional())


def test_the_probes_move_none_of_keras_automatic_names():
    keras_private._probe_model.cache_clear()

    def number(name):
        return int(name.rsplit("_", 1)[1]) if "_" in name else 0

    model = _functional()
    before = keras.layers.Dense(1).name, keras.Model(model.inputs, model.outputs).name
    keras_private.graph_nodes(model)  # builds the probe
    keras_private.build_shapes(model)
    after = keras.layers.Dense(1).name, keras.Model(model.inputs, model.outputs).name
    # The next automatic names, as if no probe had been built.
    assert [number(a) - number(b) for a, b in zip(after, before, strict=True)] == [1, 1]


def test_a_class_that_moved_and_is_re_exported_does_not_resolve():
    # kmp matches a class by where it is defined, not where it is importable.
    assert keras_hub_names._resolves("keras.src.layers.core.dense.Dense")
    assert not keras_hub_names._resolves("keras.layers.Dense")
    assert not keras_hub_names._resolves("no_such_module.Dense")


def test_what_kmp_reads_of_tensorflow_is_there():

    assert tensorflow_private.op_determinism_enabled() is False
    # The default strategy applies its updates in replica context.
    assert tensorflow_private.strategy_supports_no_merge_call() is True


def test_autographs_source_map_names_the_users_line_of_converted_code():
    import inspect
    import sys

    origins = []

    @tf.autograph.experimental.do_not_convert
    def probe():
        frame = sys._getframe(1)
        while frame is not None and not autograph.is_converted(frame):
            frame = frame.f_back  # autograph's own frames
        # Read while the frame runs, in the converted copy's temporary file.
        assert frame.f_code.co_filename != __file__
        origins.append(autograph.origin(frame))

    @tf.function
    def converted(n):
        probe()  # straight-line code
        for _ in tf.range(n):
            probe()  # a loop's body: a function of its own
        if n > 0:
            probe()  # a branch

        def nested():
            probe()

        nested()
        (lambda: probe())()

    converted(tf.constant(1))
    lines, first = inspect.getsourcelines(converted.python_function)
    probed = [first + i for i, text in enumerate(lines) if "probe()" in text]
    assert origins == [(__file__, line) for line in probed]
    # A frame of code that autograph did not convert: no origin.
    assert not autograph.is_converted(sys._getframe())
    assert autograph.origin(sys._getframe()) is None
