"""kmp.traversal: the traversal that says who consumes each layer's output."""

import keras

from kmp.precision import traversal


class Residual(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, name="inner")

    def call(self, x):
        return x + self.inner(x)


def sites(model):
    return {s.path: s for s in traversal.walk(model)}


def test_graph_layers_cast_downstream_and_code_called_layers_do_not():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="a")(inputs)
    x = Residual(name="res")(x)
    y = keras.layers.Dense(4, name="b")(x)
    out = keras.layers.Dense(2, name="out")(x + y)  # a keras.ops node promotes
    s = sites(keras.Model(inputs, out))
    assert s["a"].in_graph and s["a"].casts_downstream and not s["a"].model_output
    assert s["b"].casts_downstream
    assert s["out"].model_output
    inner = s["res/inner"]
    assert not inner.in_graph and not inner.casts_downstream
    assert inner.user_code is s["res"].layer


def test_a_nested_model_inside_user_code_hands_its_output_to_that_code():
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="block")
            self.ffn = keras.Sequential(
                [keras.layers.Dense(4, name="d1"), keras.layers.Dense(4, name="d2")],
                name="ffn",
            )

        def call(self, x):
            return x + self.ffn(x)

    inputs = keras.Input((4,))
    s = sites(keras.Model(inputs, keras.layers.Dense(2)(Block()(inputs))))
    assert s["block/ffn/d1"].casts_downstream  # consumed by d2, which casts
    assert not s["block/ffn/d2"].casts_downstream  # returned to Block.call
    assert not s["block/ffn/d2"].model_output


def test_outputs_are_found_through_nested_models_and_shared_layers_once():
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="last")], name="inner"
    )
    shared = keras.layers.Dense(4, name="shared")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, inner(shared(shared(inputs))))
    s = list(traversal.walk(model))
    assert [site.path for site in s].count("shared") == 1
    outputs = [site.path for site in s if site.model_output]
    assert outputs == ["inner", "inner/last"]  # the nested model, and its layer


def test_a_layer_without_casting_consumers_is_not_safe_to_change():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="a")(inputs)
    out = keras.layers.Dense(2, name="out", autocast=False)(x)
    assert not sites(keras.Model(inputs, out))["a"].casts_downstream


def test_a_subclassed_model_has_no_graph_and_no_known_outputs():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    net = Net()
    assert not traversal.is_graph(net)
    s = list(traversal.walk(net))
    assert [site.user_code for site in s] == [net]
    assert not any(site.model_output or site.casts_downstream for site in s)


def test_float_input_readers_are_marked():
    ids = keras.Input((3,))
    ints = keras.Input((3,), dtype="int32")
    x = keras.layers.Dense(2, name="reads")(ids)
    y = keras.layers.Embedding(10, 2, name="ints")(ints)
    model = keras.Model([ids, ints], [x, y])
    s = sites(model)
    assert s["reads"].reads_float_input and not s["ints"].reads_float_input


def test_a_change_passes_through_promoting_ops_to_their_consumers():
    # h * p promotes: a float32 p would make the product float32, which the
    # nested model returns to Block.call's raw `+`.
    i = keras.Input((4,))
    h = keras.layers.Dense(4, name="h")(i)
    inner = keras.Model(i, h * keras.layers.Softmax(name="p")(h), name="inner")

    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="block")
            self.inner = inner

        def call(self, x):
            return x + self.inner(x)

    inputs = keras.Input((4,))
    s = sites(keras.Model(inputs, keras.layers.Dense(2)(Block()(inputs))))
    assert not s["block/inner/p"].casts_downstream
    assert s["block/inner/h"].casts_downstream is False  # h feeds the product too


def test_ops_that_do_not_promote_stop_a_change():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="h")(inputs)
    p = keras.layers.Softmax(name="p")(h)
    out = keras.layers.Dense(2)(keras.ops.slice_update(h, [0, 0], p))
    site = sites(keras.Model(inputs, out))["p"]
    assert not site.casts_downstream
    assert site.blocker == "keras.ops SliceUpdate"


def test_layers_that_cast_inside_absorb_a_change():
    inputs = keras.Input((5, 4))
    x = keras.layers.Attention(name="att")([inputs, inputs])
    x = keras.layers.LayerNormalization(name="norm")(x)  # autocast=False
    s = sites(keras.Model(inputs, keras.layers.Dense(2)(x)))
    assert s["att"].casts_downstream


def test_an_output_is_found_through_ops_that_keep_its_dtype():
    inputs = keras.Input((4,))
    value = keras.layers.Dense(1, name="value")(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.ops.squeeze(value, -1))
    assert sites(model)["value"].model_output
