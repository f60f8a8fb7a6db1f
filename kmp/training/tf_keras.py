"""tf.keras 2's mixed-precision API, mapped onto kmp.

Code written for tf.keras 2 (TensorFlow's mixed-precision guide, and most
mixed-precision code in the wild) runs with its import line changed:

    from tensorflow.keras import mixed_precision   # before
    from kmp import mixed_precision                # after

* `Policy(name)`, `global_policy()`: Keras's own policy class and getter
  (`keras.mixed_precision.Policy` is `keras.DTypePolicy`, which takes
  tf.keras 2's one argument);
* `set_global_policy(policy)`: `kmp.set_policy`, so kmp's machine settings
  come with it (on a machine without GPUs, the float16 CPU fast path);
* `LossScaleOptimizer(inner_optimizer, dynamic=True, initial_scale=None,
  dynamic_growth_steps=None)`: a `kmp.LossScaleOptimizer` with tf.keras 2's
  arguments and tf.keras 2's contract: `get_scaled_loss`,
  `get_unscaled_gradients`, then `apply_gradients` takes the unscaled
  gradients (a `kmp.LossScaleOptimizer`'s `apply_gradients` takes the
  gradients of a scaled loss, as Keras 3's does). It has tf.keras 2's
  `loss_scale`, `dynamic`, `dynamic_counter`, `initial_scale`,
  `dynamic_growth_steps` and `inner_optimizer`.

What the import cannot change: `model.compile(...)` is Keras's, and under
`mixed_float16` it wraps the optimizer in Keras's own `LossScaleOptimizer`
(tf.keras 2 did the same with its own). Write `kmp.compile(model, ...)`
instead to get kmp's loss scaling, precision rules and telemetry in `fit`.

Example:

>>> from kmp import mixed_precision
>>> policy = mixed_precision.Policy("mixed_float16")
>>> mixed_precision.set_global_policy(policy)
>>> policy.compute_dtype, policy.variable_dtype
('float16', 'float32')
>>> opt = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
>>> isinstance(opt, kmp.LossScaleOptimizer), float(opt.loss_scale)
(True, 32768.0)
>>> mixed_precision.set_global_policy("float32")
"""

from __future__ import annotations

from typing import Any

import keras

from kmp._base import backends
from kmp.precision import policy as policy_lib
from kmp.scaling import config as ls_config
from kmp.scaling import optimizer as optimizer_lib
from kmp.scaling import unscaling

Policy = keras.mixed_precision.Policy
global_policy = keras.mixed_precision.global_policy


def set_global_policy(policy: str | keras.DTypePolicy | policy_lib.Policy) -> None:
    """Sets the global dtype policy, as tf.keras 2's function of that name did.

    The same as `kmp.set_policy(policy)` (which also accepts kmp's own names
    such as `'auto'`), returning `None` as tf.keras 2 did.

    Args:
        policy: A policy name (`'mixed_float16'`, `'mixed_bfloat16'`,
            `'float32'`, ...) or a `Policy`.
    """
    policy_lib.set_policy(policy)


@keras.saving.register_keras_serializable(
    package="kmp", name="TfKeras2LossScaleOptimizer"
)
class LossScaleOptimizer(optimizer_lib.LossScaleOptimizer):
    """tf.keras 2's `LossScaleOptimizer(inner_optimizer, dynamic=True,
    initial_scale=None, dynamic_growth_steps=None)`, with tf.keras 2's
    contract: `apply_gradients` (and `apply`) take the unscaled gradients
    that `get_unscaled_gradients` returns.

    A `kmp.LossScaleOptimizer` in every other way (kmp's skip, floor,
    telemetry and saving). Keras 3's `fit` cannot use it: Keras's trainer
    hands `apply_gradients` the gradients of `scale_loss(loss)`, which this
    contract does not take, so `scale_loss` refuses with the fix (compile
    with `kmp.compile(model, optimizer=inner)`, or a `kmp.LossScaleOptimizer`).
    A `train_step` of your own that uses tf.keras 2's calls works as written.

    Args:
        inner_optimizer: The optimizer to wrap (or an optimizer name).
        dynamic: Whether the loss scale changes during training (kmp's
            `mode='dynamic'`); `False` keeps it fixed at `initial_scale`
            (`mode='static'`).
        initial_scale: The first loss scale; `None` means 32768 (2**15) with
            dynamic scaling. Required when `dynamic` is `False`.
        dynamic_growth_steps: Finite steps between doublings of the scale
            (`None`: 2000). Must be `None` when `dynamic` is `False`.
        **kmp_settings: `kmp.LossScaleOptimizer`'s own settings (a floor and
            a ceiling under the scale, hysteresis, the fused update, name).

    Example:

    >>> from kmp import mixed_precision
    >>> opt = mixed_precision.LossScaleOptimizer(
    ...     keras.optimizers.SGD(0.5), dynamic=False, initial_scale=1024)
    >>> opt.mode, opt.dynamic, float(opt.loss_scale)
    ('static', False, 1024.0)
    >>> w = keras.Variable(2.0)
    >>> with tf.GradientTape() as tape:
    ...     scaled_loss = opt.get_scaled_loss(w * w)
    >>> grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, [w]))
    >>> float(grads[0])
    4.0
    >>> _ = opt.apply_gradients(zip(grads, [w]))
    >>> float(w)
    0.0
    """

    _contract = unscaling.UNSCALED

    def __init__(
        self,
        inner_optimizer: Any,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        **kmp_settings: Any,
    ):
        backends.require_tensorflow(
            "kmp.mixed_precision.LossScaleOptimizer, tf.keras 2's surface,",
            "Use kmp.LossScaleOptimizer, Keras 3's contract.",
        )
        if "mode" in kmp_settings:  # from get_config: kmp's own names
            if initial_scale is not None:
                kmp_settings["initial_scale"] = initial_scale
            if dynamic_growth_steps is not None:
                kmp_settings["dynamic_growth_steps"] = dynamic_growth_steps
            super().__init__(inner_optimizer, **kmp_settings)
            return
        if not isinstance(dynamic, bool):
            raise TypeError(
                f"dynamic must be True or False. Received: {dynamic!r} (of type "
                f"{type(dynamic).__name__})."
            )
        if dynamic:
            super().__init__(
                inner_optimizer,
                initial_scale=(
                    ls_config.LossScaleConfig().initial_scale
                    if initial_scale is None
                    else initial_scale
                ),
                dynamic_growth_steps=(
                    ls_config.LossScaleConfig().dynamic_growth_steps
                    if dynamic_growth_steps is None
                    else dynamic_growth_steps
                ),
                **kmp_settings,
            )
            return
        if initial_scale is None:
            raise ValueError(
                "initial_scale must be given when dynamic is False: it is the "
                "fixed loss scale. For example LossScaleOptimizer(opt, "
                "dynamic=False, initial_scale=1024)."
            )
        if dynamic_growth_steps is not None:
            raise ValueError(
                "dynamic_growth_steps must be None when dynamic is False (a fixed "
                f"loss scale never grows). Received: {dynamic_growth_steps!r}."
            )
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            mode=ls_config.STATIC,
            **kmp_settings,
        )

    def __repr__(self) -> str:
        return (
            super()
            .__repr__()
            .replace(
                "<kmp.LossScaleOptimizer", "<kmp.mixed_precision.LossScaleOptimizer", 1
            )
        )

    @property
    def dynamic(self) -> bool:
        """Whether the scale moves (mode `'dynamic'`)."""
        return self.mode == ls_config.DYNAMIC

    @property
    def dynamic_counter(self) -> keras.Variable | None:
        """The finite steps since the scale last changed (`None` unless
        `dynamic`)."""
        return self.good_steps if self.dynamic else None

    def get_scaled_loss(self, loss):
        """Returns `loss * scale`. Given a callable that returns the loss,
        returns a callable that returns the scaled loss, as tf.keras 2 did."""
        scale_loss = super().scale_loss
        if callable(loss):
            return lambda: scale_loss(loss())
        return scale_loss(loss)

    def get_unscaled_gradients(self, grads, variables=None):
        """Returns `grads / scale`: the unscaled gradients of a scaled loss,
        to clip, log or hand to `apply_gradients`.

        Args:
            grads: Gradients of a scaled loss.
            variables: Optional, their variables, so that Keras's
                overwrite-with-gradient variables (float8 scales) are left
                alone.
        """
        return self._unscale(grads, variables)

    def scale_loss(self, loss):
        """Refused: Keras 3's trainer calls `scale_loss` and then hands
        `apply_gradients` the scaled gradients, which tf.keras 2's contract
        does not take."""
        raise unscaling.LossScaleError(
            "kmp.mixed_precision.LossScaleOptimizer keeps tf.keras 2's contract "
            "(apply_gradients takes the unscaled gradients get_unscaled_gradients "
            "returns), but scale_loss is Keras 3's call: Keras's fit calls it and "
            "then hands apply_gradients the gradients of the scaled loss. For "
            "fit, compile with kmp.compile(model, optimizer=inner_optimizer) or "
            "pass kmp.LossScaleOptimizer(inner_optimizer), whose apply_gradients "
            "takes fit's gradients. In a custom loop, use get_scaled_loss, "
            "get_unscaled_gradients and apply_gradients."
        )


__all__ = ["LossScaleOptimizer", "Policy", "global_policy", "set_global_policy"]
