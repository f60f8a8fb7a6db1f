"""A model's outputs cast to float32 where `predict` hands them on.

The layers that produce a model's outputs keep their 16-bit policy
(`kmp.planning.decisions`); the output is cast at the boundary, as JMP's
output dtype and TensorFlow's `Activation('linear', dtype='float32')` do.
Keras's losses and metrics already cast what they receive to float32.
`predict` returns what the model computes: kmp sets `model.predict_function`
to a `Float32Predict`, which Keras's `make_predict_function` keeps (it
makes one only where there is none). It runs Keras's own function and casts
its float16 and bfloat16 outputs to float32. Calling the model yourself
(`model(x)`) returns its compute dtype, as in Keras.

Keras makes a predict function of its own, without the cast, where
something drops this one: Keras's `compile` (`kmp.compile` and
`kmp.telemetry.attach` set it again after it) and
`make_predict_function(force=True)` (`Model.quantize`, some KerasHub
setters). `kmp.prepare` or `kmp.compile` afterwards sets it again.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras

from kmp.backend.jax import state as jax_state
from kmp.precision import policy as policy_lib


class Float32Predict:
    """`model.predict_function` as kmp sets it: Keras's own, made at the
    first call, with 16-bit float outputs cast to float32. Unless the model
    runs eagerly, the cast is traced with Keras's function into one
    `tf.function`: no op runs outside the graph."""

    def __init__(self, model: keras.Model):
        self._model = weakref.ref(model)
        self._function = None

    def __call__(self, *args: Any) -> Any:
        """TensorFlow: `(data)` -> outputs; JAX: `(state, iterator)` ->
        `(outputs, state)`, as Keras's own function."""
        if self._function is None:
            model = self._model()
            if model is None:
                raise RuntimeError(
                    "This predict function belongs to a model that no longer "
                    "exists. Call predict on a live model."
                )
            model.predict_function = None
            jax = keras.backend.backend() == "jax"
            try:
                if jax:
                    # JAX: fit has taken the values out of the variables,
                    # whose shardings Keras reads from them.
                    with keras.StatelessScope(jax_state.mapping(model, args[0])):
                        model.make_predict_function()
                else:
                    model.make_predict_function()
                inner = model.predict_function
            finally:
                model.predict_function = self
            self._function = _cast(inner, model, jax=jax)
        return self._function(*args)


def _cast(inner: Any, model: keras.Model, jax: bool) -> Any:
    """`inner` (Keras's predict function) with its 16-bit outputs cast to
    float32: traced with it into one `tf.function` on TensorFlow, unless
    the model runs eagerly; on JAX, after each call of its jitted step."""
    if jax:

        def cast_outputs(state, iterator):
            outputs, state = inner(state, iterator)
            return keras.tree.map_structure(_float32, outputs), state

        return cast_outputs

    def cast(data):
        return keras.tree.map_structure(_float32, inner(data))

    if model.run_eagerly:
        return cast
    import tensorflow as tf

    return tf.function(cast, reduce_retracing=True, autograph=False)


def _float32(x: Any) -> Any:
    # A dtype's name, without Keras's standardize_dtype, which refuses some
    # (strings, TensorFlow's variant) that Keras's predict passes through.
    name = getattr(getattr(x, "dtype", None), "name", None)
    if name in policy_lib.SIXTEEN_BIT:
        return keras.ops.cast(x, "float32")
    return x


def install(model: keras.layers.Layer) -> None:
    """Sets a `Float32Predict` as `model.predict_function`, unless it has
    one (a Keras model; other layers have no `predict`). Set it to None
    first to drop a function traced with the layers' old policies."""
    if isinstance(model, keras.Model) and not isinstance(
        model.predict_function, Float32Predict
    ):
        model.predict_function = Float32Predict(model)
