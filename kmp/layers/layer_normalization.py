"""`kmp.layers.LayerNormalization`: Keras's layer normalization, keeping a
16-bit input as it is for the backward pass."""

from __future__ import annotations

import keras

from kmp.backend import normalization
from kmp.backend import tracing
from kmp.precision import policy as policy_lib


@keras.saving.register_keras_serializable(package="kmp")
class LayerNormalization(keras.layers.LayerNormalization):
    """Keras's `LayerNormalization`, keeping its 16-bit input as it is for the
    backward pass instead of a float32 copy.

    Keras's layer casts a float16 or bfloat16 input to float32 and computes
    from that copy, which the backward pass reads: each normalization keeps
    a float32 tensor the size of its input until the gradient is computed.
    This layer computes the same in float32 and keeps, for the backward
    pass, the 16-bit input alone; its gradient recomputes the statistics
    and normalized values from it, in float32 (a pass more over the input,
    and second derivatives stay exact).

    Everything else is Keras's layer: the same arguments, weights and
    `get_config`, so a model saved with it loads with `import kmp`. Where
    this computation does not apply, the layer computes as Keras's does:
    float32 inputs, weights that are not float32 (a pure 16-bit policy),
    `rms_scaling=True`, normalization over axes other than the last alone,
    or a last axis whose size is unknown when the call is traced.

    `kmp.layers.lean(model, attention=False)` puts this layer in place of
    Keras's in a model that is built and not compiled yet.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> norm = kmp.layers.LayerNormalization()
    >>> norm(np.ones((4, 3), "float32")).dtype
    tf.bfloat16
    """

    def call(self, inputs):
        # kmp's computation is TensorFlow's: on JAX the layer is Keras's.
        if keras.backend.backend() != "tensorflow" or not (
            fusable_settings(self) and _over_last_axis(self, inputs)
        ):
            return super().call(inputs)
        features = inputs.shape[-1]
        scale, offset = normalization.scale_and_offset(self, features)
        outputs = normalization.layer_normalization(inputs, scale, offset, self.epsilon)
        return keras.ops.cast(outputs, self.compute_dtype)


def axes(layer: keras.layers.LayerNormalization) -> list[int]:
    return list(layer.axis) if isinstance(layer.axis, (list, tuple)) else [layer.axis]


def _over_last_axis(layer, inputs) -> bool:
    rank = inputs.shape.rank
    return (
        normalization.fusable(inputs, -1)
        and len(axes(layer)) == 1
        and axes(layer)[0] in (-1, rank - 1)
    )


def fusable_settings(layer: keras.layers.LayerNormalization) -> bool:
    """Whether the layer's settings allow kmp's computation: no RMS scaling,
    float32 weights."""
    return not layer.rms_scaling and all(
        weight.dtype == "float32" for weight in layer.weights
    )


def keeps_float32_copy(layer: keras.layers.Layer) -> bool:
    """Whether `layer` is a Keras `LayerNormalization` (not kmp's) that, in
    the functional graph it was called in, gets a 16-bit input and keeps a
    float32 copy of it for the backward pass, where
    `kmp.layers.LayerNormalization` with the same settings would keep the
    16-bit input. Keras's layer takes its input in the dtype it comes in,
    whatever its policy; where that input is not recorded (a layer called
    by a subclassed model's code, or on several inputs), False."""
    if not isinstance(layer, keras.layers.LayerNormalization) or isinstance(
        layer, LayerNormalization
    ):
        return False
    spec = tracing.recorded_input(layer)
    if spec is None or not layer.built or not fusable_settings(layer):
        return False
    rank = len(spec.shape)
    return (
        keras.backend.standardize_dtype(spec.dtype) in policy_lib.SIXTEEN_BIT
        and len(axes(layer)) == 1
        and axes(layer)[0] in (-1, rank - 1)
        and spec.shape[-1] is not None
    )
