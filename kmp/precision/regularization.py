"""Activity regularization in float32.

Keras computes a layer's activity-regularization loss from the layer's
output in its compute dtype: under a 16-bit policy the loss is 16-bit, so
Keras's own `compute_loss` fails to add it to the float32 loss (`Cannot
convert a list containing a tensor of dtype float16`), so does a user's
`loss += ops.sum(self.losses)`, and in float16 a sum of squares of large
activations overflows. `compute_in_float32(layer)` gives a 16-bit layer's
activity regularizer its input in float32, so that the loss it adds is
float32; the layer's output is unchanged.

The regularizer is wrapped, and the wrapper reports the class and config of
the regularizer it wraps (`get_config`, `__class__`), so that `get_config`,
`model.save` and `clone_model` write the user's regularizer as it was: a
saved model loads without kmp, and `kmp.compile` wraps it again.
"""

from __future__ import annotations

from typing import Any

import keras


class Float32Activity(keras.regularizers.Regularizer):
    """Calls a regularizer on its input cast to float32.

    Args:
        regularizer: The layer's `keras.regularizers.Regularizer`.

    Example:

    >>> reg = kmp.precision.regularization.Float32Activity(keras.regularizers.L2(0.5))
    >>> keras.backend.standardize_dtype(reg(np.ones((2,), "float16")).dtype)
    'float32'
    >>> type(reg).__name__, reg.__class__.__name__, reg.get_config()
    ('Float32Activity', 'L2', {'l2': 0.5})
    """

    def __init__(self, regularizer: keras.regularizers.Regularizer):
        object.__setattr__(self, "regularizer", regularizer)

    @property
    def __class__(self):
        # What Keras serializes: the regularizer wrapped, as the user wrote it.
        return type(self.regularizer)

    def __call__(self, x: Any) -> Any:
        return self.regularizer(keras.ops.cast(x, "float32"))

    def get_config(self) -> dict:
        return self.regularizer.get_config()

    def __getattr__(self, name: str) -> Any:
        # Only for names this class lacks: the wrapped regularizer's own
        # attributes (`l2`, ...).
        return getattr(object.__getattribute__(self, "regularizer"), name)


def compute_in_float32(layer: keras.layers.Layer) -> bool:
    """Wraps `layer`'s activity regularizer (a `Regularizer` object) in
    `Float32Activity`; True when it did. Idempotent."""
    regularizer = getattr(layer, "activity_regularizer", None)
    if not isinstance(regularizer, keras.regularizers.Regularizer):
        return False
    if type(regularizer) is Float32Activity:
        return False
    layer.activity_regularizer = Float32Activity(regularizer)
    return True
