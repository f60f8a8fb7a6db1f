"""`kmp.ScaledGradientTape`: a `tf.GradientTape` that returns unscaled gradients
computed from a scaled loss."""

from __future__ import annotations

from typing import Any

import keras

from kmp._base import backends
from kmp.scaling import loss_scale as ls
from kmp.scaling.optimizer import LossScaleOptimizer

if keras.backend.backend() == "tensorflow":
    from tensorflow import GradientTape as _Tape
else:  # The class exists on JAX too, and its __init__ refuses it.
    _Tape = object


class ScaledGradientTape(_Tape):
    """A `tf.GradientTape` whose `gradient()` scales the loss and returns
    unscaled gradients.

    Backpropagation starts from `scale` instead of 1 (the same as
    differentiating `loss * scale`), so small float16 gradients do not
    underflow on the way; the result is divided by the scale. Apply them
    with `optimizer.apply(grads, variables, scaled=False)` (they are
    unscaled; `apply` without it takes the gradients of a scaled loss, and
    refuses these in the same step): it skips the step if any is inf/NaN,
    updates the scale, and returns whether it applied. Clip the returned
    gradients as you like.

    Works eagerly and inside `tf.function`, with `persistent=True`, and for
    gradients of gradients (the inner tape can be a plain `tf.GradientTape`).

    Args:
        optimizer: The `kmp.LossScaleOptimizer` that owns the scale.
        persistent: As for `tf.GradientTape`.
        watch_accessed_variables: As for `tf.GradientTape`.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    >>> w = keras.Variable(2.0)
    >>> with kmp.ScaledGradientTape(opt) as tape:
    ...     loss = w * w
    >>> grads = tape.gradient(loss, [w])
    >>> float(grads[0])
    4.0
    >>> bool(opt.apply(grads, [w], scaled=False)), float(w)
    (True, 0.0)
    """

    def __init__(
        self,
        optimizer: LossScaleOptimizer,
        persistent: bool = False,
        watch_accessed_variables: bool = True,
    ):
        backends.require_tensorflow(
            "kmp.ScaledGradientTape, a tf.GradientTape,",
            "On JAX, take the gradients of optimizer.scale_loss(loss) with "
            "jax.value_and_grad and hand them to optimizer.stateless_apply, "
            "which unscales them (see the JAX page of kmp's docs).",
        )
        if not isinstance(optimizer, LossScaleOptimizer):
            raise TypeError(
                "ScaledGradientTape needs the kmp.LossScaleOptimizer that owns the "
                "loss scale: kmp.ScaledGradientTape(kmp.LossScaleOptimizer(adam)). "
                f"Received: {optimizer!r} (of type {type(optimizer).__name__})."
            )
        super().__init__(
            persistent=persistent, watch_accessed_variables=watch_accessed_variables
        )
        self._optimizer = optimizer

    @property
    def optimizer(self) -> LossScaleOptimizer:
        return self._optimizer

    def __enter__(self):
        # While it records, a scale_loss() in the same step would scale twice
        # (the optimizer's ledger refuses it).
        self._optimizer._ledger.tape_entered()
        try:
            return super().__enter__()
        except BaseException:
            self._optimizer._ledger.tape_exited()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._optimizer._ledger.tape_exited()

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = "none",  # tf.UnconnectedGradients.NONE
    ) -> Any:
        """Returns the unscaled gradients of `target` with respect to `sources`.

        Same arguments and return structure as `tf.GradientTape.gradient`.
        Apply them with `optimizer.apply(grads, variables, scaled=False)`.
        Those of variables Keras overwrites with their "gradient" (float8
        scales and histories) are returned as Keras computes them, never
        divided.
        """
        import tensorflow as tf

        for t in tf.nest.flatten(target):
            # A 16-bit loss warns once: its gradient starts at the scale, in
            # its dtype.
            ls.check_loss(t, self._optimizer.mode, self._optimizer)
            self._optimizer._record_loss(t)
        scale = self._optimizer._scale
        if not scale.scaling:  # mode 'none': a plain tape
            return super().gradient(
                target, sources, output_gradients, unconnected_gradients
            )
        value = tf.convert_to_tensor(scale.value)
        if output_gradients is None:
            seeds = tf.nest.map_structure(
                lambda t: tf.ones_like(t) * tf.cast(value, t.dtype), target
            )
        else:
            seeds = tf.nest.map_structure(
                lambda o: o * tf.cast(value, o.dtype), output_gradients
            )
        grads = super().gradient(target, sources, seeds, unconnected_gradients)
        flat = self._optimizer._unscale(
            tf.nest.flatten(grads), tf.nest.flatten(sources)
        )
        return tf.nest.pack_sequence_as(grads, flat)
