"""Adam and AdamW with their moments kept in bfloat16.

Adam keeps two moments per weight; in float32 they take twice the memory
of the float32 weights themselves, and more than the weights, gradients and
16-bit activations of a large model together. Kept in bfloat16 they take
half. The update is computed in float32 (the moments are read as float32,
updated, and the weights updated from the float32 values), and only what
is stored is rounded: stochastically by default (`kmp.backend.rounding`;
on JAX, `kmp.backend.jax.rounding`),
because a moment rounded to nearest stops moving once its change per step
is below half a bfloat16 step (Adam's second moment changes by 0.1 % per
step at `beta_2=0.999`, a quarter of a step). The weights stay float32.
Stochastic rounding draws a random integer per stored value per step, so
the update does more work than Keras's (a pass more per moment); where kmp
fuses the update (`fused_update=`), that pass is fused with the rest.

Keras offers no such option; these classes subclass Keras's own `Adam` and
`AdamW`, with every option of theirs (weight decay, clipping, EMA,
gradient accumulation, schedules, AMSGrad), and only the storage of the
moments changed. `state_dtype="float32"` gives Keras's update exactly.
"""

from __future__ import annotations

from typing import Any

import keras

from kmp.backend import distribute
from kmp.backend import rounding as rounding_lib
from kmp.backend.jax import rounding as jax_rounding

STATE_DTYPES = ("bfloat16", "float32")


class _HalfState:
    """What `Adam` and `AdamW` share: the moments' storage and the update."""

    def _init_state(self, state_dtype: str, rounding: str, seed: int) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"state_dtype must be one of {STATE_DTYPES}. Received: "
                f"{state_dtype!r}. (float16 is not offered: Adam's second "
                "moment, a squared gradient, underflows its range.)"
            )
        if rounding not in rounding_lib.ROUNDINGS:
            raise ValueError(
                f"rounding must be one of {rounding_lib.ROUNDINGS}. "
                f"Received: {rounding!r}."
            )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an integer. Received: {seed!r}.")
        self.state_dtype = state_dtype
        self.rounding = rounding
        self.seed = seed

    def build(self, var_list):
        if self.built:
            return
        keras.optimizers.Optimizer.build(self, var_list)
        names = ["momentum", "velocity"] + (["velocity_hat"] * self.amsgrad)
        slots = {name: [] for name in names}
        for variable in var_list:
            for name in names:
                slots[name].append(
                    None
                    if getattr(variable, "overwrite_with_gradient", False)
                    else self._state_variable(variable, name)
                )
        self._momentums = slots["momentum"]
        self._velocities = slots["velocity"]
        if self.amsgrad:
            self._velocity_hats = slots["velocity_hat"]

    def _state_variable(self, variable, name: str):
        """A moment of `variable`, named as Keras names its own."""
        path = getattr(variable, "path", None) or str(variable.name)
        dtype = self.state_dtype
        if not keras.backend.is_float_dtype(variable.dtype) or (
            keras.backend.standardize_dtype(variable.dtype) != "float32"
        ):
            dtype = variable.dtype  # only float32 weights get 16-bit moments
        name = f"{path.replace('/', '_').replace(':', '_')}_{name}"
        # Placed with its weight, as Keras places its own optimizers' slots
        # (`add_variable_from_reference`, which cannot take another dtype).
        with distribute.colocated_with(variable):
            return self.add_variable(shape=variable.shape, dtype=dtype, name=name)

    def _store(self, slot, value, index: int, which: int) -> None:
        """Writes `value` (the weight's dtype) into the moment `slot`."""
        if slot.dtype == value.dtype:
            self.assign(slot, value)
            return
        if keras.backend.backend() == "jax":
            # A draw per step, per moment, from JAX's generator.
            rounded = jax_rounding.to_bfloat16(
                value,
                self.rounding,
                self.seed,
                # A tensor: with gradient accumulation, `iterations` is
                # computed, not a variable.
                keras.ops.convert_to_tensor(self.iterations),
                3 * index + which,
            )
            self.assign(slot, rounded)
            return
        seed = None
        if self.rounding == "stochastic":
            # A draw per step, per moment: (seed, step), (variable, moment).
            seed = rounding_lib.step_seed(self.seed, self.iterations, 3 * index + which)
        self.assign(slot, rounding_lib.to_bfloat16(value, self.rounding, seed))

    def update_step(self, gradient, variable, learning_rate):
        """Keras's Adam update, computed in the weight's dtype, with the
        moments stored in `state_dtype`."""
        dtype = variable.dtype
        ops = keras.ops
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        local_step = ops.cast(self.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(self.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(self.beta_2, dtype), local_step)
        index = self._get_variable_index(variable)
        m_slot = self._momentums[index]
        v_slot = self._velocities[index]
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m = ops.cast(m_slot, dtype)
        v = ops.cast(v_slot, dtype)
        m = m + (gradient - m) * (1 - self.beta_1)
        v = v + (ops.square(gradient) - v) * (1 - self.beta_2)
        self._store(m_slot, m, index, 0)
        self._store(v_slot, v, index, 1)
        if self.amsgrad:
            v_hat_slot = self._velocity_hats[index]
            v = ops.maximum(ops.cast(v_hat_slot, dtype), v)
            self._store(v_hat_slot, v, index, 2)
        self.assign_sub(variable, m * alpha / (ops.sqrt(v) + self.epsilon))

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "state_dtype": self.state_dtype,
            "rounding": self.rounding,
            "seed": self.seed,
        }


@keras.saving.register_keras_serializable(package="kmp")
class Adam(_HalfState, keras.optimizers.Adam):
    """`keras.optimizers.Adam` with its moments in bfloat16 (half the
    optimizer memory), float32 weights, and the update computed in float32.

    Args:
        learning_rate: As for `keras.optimizers.Adam`.
        beta_1: As for `keras.optimizers.Adam`.
        beta_2: As for `keras.optimizers.Adam`.
        epsilon: As for `keras.optimizers.Adam`.
        amsgrad: As for `keras.optimizers.Adam` (the maximum of the second
            moments is stored in `state_dtype` too).
        state_dtype: `'bfloat16'` (default) or `'float32'` (Keras's update
            exactly). Moments of weights that are not float32 keep the
            weight's dtype.
        rounding: How a moment is rounded to bfloat16: `'stochastic'`
            (default: unbiased, so that small changes accumulate) or
            `'nearest'` (changes below half a bfloat16 step are lost).
        seed: Selects the random draws of stochastic rounding (each step
            and moment draws its own, from this seed and the step number).
            Two optimizers with the same seed draw the same: give each of
            a model's optimizers its own (a GAN's two, for example).
        **kwargs: Keras's other optimizer arguments (weight decay, clipping,
            EMA, gradient accumulation, ...).

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
    >>> optimizer = kmp.optimizers.Adam(1e-3)
    >>> optimizer.build(model.trainable_variables)
    >>> [v.dtype for v in optimizer.variables[2:]]  # the kernel's, the bias's
    ['bfloat16', 'bfloat16', 'bfloat16', 'bfloat16']
    """

    # Tested to compute, fused (`fused_update=`), what its own update computes
    # (tests/test_fused.py); read from this class alone, not a subclass.
    _kmp_fused_tested = True

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        *,
        state_dtype: str = "bfloat16",
        rounding: str = "stochastic",
        seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            **kwargs,
        )
        self._init_state(state_dtype, rounding, seed)


@keras.saving.register_keras_serializable(package="kmp")
class AdamW(_HalfState, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` with its moments in bfloat16 (half the
    optimizer memory), float32 weights, and the update computed in float32.

    Args:
        learning_rate: As for `keras.optimizers.AdamW`.
        weight_decay: As for `keras.optimizers.AdamW`.
        beta_1: As for `keras.optimizers.AdamW`.
        beta_2: As for `keras.optimizers.AdamW`.
        epsilon: As for `keras.optimizers.AdamW`.
        amsgrad: As for `kmp.optimizers.Adam`.
        state_dtype: As for `kmp.optimizers.Adam`.
        rounding: As for `kmp.optimizers.Adam`.
        seed: As for `kmp.optimizers.Adam`.
        **kwargs: Keras's other optimizer arguments.

    Example:

    >>> optimizer = kmp.optimizers.AdamW(1e-3, weight_decay=0.01)
    >>> optimizer.get_config()["state_dtype"], optimizer.get_config()["rounding"]
    ('bfloat16', 'stochastic')
    """

    # Tested to compute, fused (`fused_update=`), what its own update computes
    # (tests/test_fused.py); read from this class alone, not a subclass.
    _kmp_fused_tested = True

    def __init__(
        self,
        learning_rate: Any = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        *,
        state_dtype: str = "bfloat16",
        rounding: str = "stochastic",
        seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            **kwargs,
        )
        self._init_state(state_dtype, rounding, seed)
