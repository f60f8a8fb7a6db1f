"""Every private attribute of Keras, KerasHub and TensorFlow kmp reads is
still there in the installed versions (`kmp.internals`), and an accessor
fails closed where one is not."""

import importlib

import keras
import pytest

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
    methods = keras_private.attention_methods(keras.layers.MultiHeadAttention)
    assert len(methods) == len(keras_private.ATTENTION_METHODS)
    variable = model.get_layer("head").kernel
    assert keras_private.backing_variable(variable) is not variable


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


def test_op_determinism_is_read_from_the_installed_tensorflow():
    assert tensorflow_private.op_determinism_enabled() is False
