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
  dynamic_growth_steps=None)`: tf.keras 2's arguments, building a
  `kmp.LossScaleOptimizer`, which has tf.keras 2's `get_scaled_loss`,
  `get_unscaled_gradients`, `apply_gradients`, `loss_scale`, `dynamic`,
  `dynamic_counter`, `initial_scale`, `dynamic_growth_steps` and
  `inner_optimizer`. `isinstance(opt, mixed_precision.LossScaleOptimizer)`
  is true of every `kmp.LossScaleOptimizer`.

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
>>> isinstance(opt, mixed_precision.LossScaleOptimizer), float(opt.loss_scale)
(True, 32768.0)
>>> mixed_precision.set_global_policy("float32")
"""

from __future__ import annotations

from typing import Any

import keras

from kmp import loss_scale as ls
from kmp import optimizer as optimizer_lib
from kmp import policy as policy_lib

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


class _TfKeras2Constructor(type):
    """Builds a `kmp.LossScaleOptimizer` from tf.keras 2's arguments, and makes
    every `kmp.LossScaleOptimizer` an instance (tf.keras 2's own
    `LossScaleOptimizer` used a metaclass the same way)."""

    def __new__(mcs, name: str, bases: tuple, namespace: dict):
        if any(isinstance(base, _TfKeras2Constructor) for base in bases):
            raise TypeError(
                f"{name}: kmp.mixed_precision.LossScaleOptimizer only builds "
                "kmp.LossScaleOptimizer objects from tf.keras 2's arguments; "
                "a subclass of it would never be instantiated. Subclass "
                "kmp.LossScaleOptimizer instead."
            )
        return super().__new__(mcs, name, bases, namespace)

    def __call__(
        cls,
        inner_optimizer: Any,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
    ) -> optimizer_lib.LossScaleOptimizer:
        if not isinstance(dynamic, bool):
            raise TypeError(
                f"dynamic must be True or False. Received: {dynamic!r} (of type "
                f"{type(dynamic).__name__})."
            )
        if dynamic:
            return optimizer_lib.LossScaleOptimizer(
                inner_optimizer,
                initial_scale=(
                    ls.LossScaleConfig().initial_scale
                    if initial_scale is None
                    else initial_scale
                ),
                dynamic_growth_steps=dynamic_growth_steps,
            )
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
        return optimizer_lib.LossScaleOptimizer(
            inner_optimizer, initial_scale=initial_scale, mode=ls.STATIC
        )

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, optimizer_lib.LossScaleOptimizer)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, optimizer_lib.LossScaleOptimizer)


class LossScaleOptimizer(metaclass=_TfKeras2Constructor):
    """tf.keras 2's `LossScaleOptimizer(inner_optimizer, dynamic=True,
    initial_scale=None, dynamic_growth_steps=None)`: returns a
    `kmp.LossScaleOptimizer`.

    Args:
        inner_optimizer: The optimizer to wrap (or an optimizer name).
        dynamic: Whether the loss scale changes during training (kmp's
            `mode='dynamic'`); `False` keeps it fixed at `initial_scale`
            (`mode='static'`).
        initial_scale: The first loss scale; `None` means 32768 (2**15) with
            dynamic scaling. Required when `dynamic` is `False`.
        dynamic_growth_steps: Finite steps between doublings of the scale
            (`None`: 2000). Must be `None` when `dynamic` is `False`.

    kmp's other settings (a floor and a ceiling under the scale, hysteresis,
    the fused update) keep their defaults; pass them to
    `kmp.LossScaleOptimizer` itself to change them.

    Example:

    >>> from kmp import mixed_precision
    >>> opt = mixed_precision.LossScaleOptimizer(
    ...     keras.optimizers.SGD(), dynamic=False, initial_scale=1024)
    >>> opt.mode, opt.dynamic, float(opt.loss_scale)
    ('static', False, 1024.0)
    """


__all__ = ["LossScaleOptimizer", "Policy", "global_policy", "set_global_policy"]
