"""`kmp.LossScaleOptimizer`: a Keras optimizer that scales the loss,
unscales the gradients, skips non-finite steps and moves the scale.

It subclasses `keras.optimizers.LossScaleOptimizer`, so Keras's `compile`
never wraps it again. The loss scale and its one transition, the gradient
contract, the overflow record, the replicas' agreement, the fused update
and the saved state each live in a module of their own.

Other parts of kmp use these private hooks:

* `_ledger`, `_unscale`, `_record_loss`: the scaled tape.
* `_scale`: the tape, the debugger and the replicas' check.
* `_loss_recorded`, `_applied_loss`: telemetry, the stall check, the healer.
* `_contract`: `kmp.compile`, which keeps an optimizer of either contract.
* `_forward_watch`: the overflow healer (`kmp.diagnostics.forward_watch`).
* `_fused_apply`: the fused update's compile-ahead.
"""

from __future__ import annotations

import functools
from typing import Any

import keras

from kmp.backend import distribute
from kmp.backend import finite as finite_lib
from kmp.backend import fused
from kmp.backend.jax import step as jax_step
from kmp.internals import keras_private
from kmp.scaling import applied_loss as applied_loss_lib
from kmp.scaling import applies
from kmp.scaling import config as ls_config
from kmp.scaling import lora
from kmp.scaling import loss_scale as ls
from kmp.scaling import overflow as overflow_lib
from kmp.scaling import saved_state
from kmp.scaling import unscaling

_DEFAULT = ls_config.LossScaleConfig()


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Scales the loss so that small float16 gradients survive, and skips the
    steps whose gradients overflow.

    Each step, the loss is multiplied by the scale and the gradients are
    divided by it, in float32. A step whose gradients hold inf/NaN is
    skipped: it changes no weight, no slot and not `iterations`. Then the
    scale moves: it backs off after an overflow and grows after
    `dynamic_growth_steps` finite steps in a row. Clipping set on the inner
    optimizer acts on the unscaled gradients.

    `apply` unscales the gradients of `scale_loss(loss)`. `scaled=False`
    says they are not scaled (a `kmp.ScaledGradientTape`'s, or those of a
    loss never scaled). Where kmp cannot know, it raises
    `kmp.LossScaleError` naming the line to write. On JAX, `fit` calls
    `stateless_apply`, which does what `apply` does without side effects,
    and unscales the gradients of a loss its step scaled (Keras's
    contract). A step that scaled no loss is refused, with the line to add.

    With `mode='none'` nothing is scaled, but a step whose gradients are
    inf/NaN is still skipped and counted. `kmp.compile` uses it for models
    that compute in bfloat16 or float32.

    With `gradient_accumulation_steps=N` on the inner optimizer, Keras
    accumulates as it does without kmp. A micro-batch whose gradients
    overflow is skipped alone, so a window closes after N applied
    micro-batches.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap (an
            instance or a name such as `"adam"`).
        initial_scale: The scale to start from (the fixed scale in mode
            `'static'`). Like the next six, any real number type: Python,
            numpy or TensorFlow scalars.
        dynamic_growth_steps: Finite steps in a row before the scale grows.
        growth_factor: Multiplies the scale after `dynamic_growth_steps`
            finite steps in a row.
        backoff_factor: Multiplies the scale after an overflow.
        min_scale: The floor under the scale.
        max_scale: The ceiling over the scale.
        hysteresis: Back off at the N-th overflow in a row (1: at once).
        mode: `'dynamic'` (default), `'static'` (fixed scale) or `'none'` (no
            scaling; non-finite steps still skipped).
        fused_update: Whether the inner optimizer's update runs as one XLA
            program (the same formulas, fused). `None` (default): for Keras's
            own optimizers, on machines without GPUs or TPUs, for at least a
            million weights, outside strategies, without gradient
            accumulation. `True` or `False` force it.
        name: The optimizer's name.

    Example:

    >>> opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024)
    >>> opt
    <kmp.LossScaleOptimizer mode=dynamic initial_scale=1024.0 inner=SGD>
    >>> var = keras.Variable(1.0)
    >>> bool(opt.apply([tf.constant(float("inf"))], [var], scaled=True))  # skipped
    False
    >>> float(opt.loss_scale), float(var)
    (512.0, 1.0)
    >>> bool(opt.apply([tf.constant(512.0)], [var], scaled=True))
    True
    >>> round(float(var), 6)  # 1 - 0.1 * 512 / 512
    0.9
    """

    # What `apply` takes when the caller states nothing (kmp.scaling.unscaling).
    _contract = unscaling.SCALED

    def __init__(
        self,
        inner_optimizer: Any,
        initial_scale: float = _DEFAULT.initial_scale,
        dynamic_growth_steps: int = _DEFAULT.dynamic_growth_steps,
        *,
        growth_factor: float = _DEFAULT.growth_factor,
        backoff_factor: float = _DEFAULT.backoff_factor,
        min_scale: float = _DEFAULT.min_scale,
        max_scale: float = _DEFAULT.max_scale,
        hysteresis: int = _DEFAULT.hysteresis,
        mode: str | None = None,
        fused_update: bool | None = None,
        name: str | None = None,
        **kwargs: Any,
    ):
        inner_optimizer = ls_config.checked_inner(inner_optimizer, kwargs)
        config = ls_config.LossScaleConfig(
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            dynamic_growth_steps=dynamic_growth_steps,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            mode=ls_config.DYNAMIC if mode is None else mode,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=config.initial_scale,
            dynamic_growth_steps=config.dynamic_growth_steps,
            name=name,
        )
        self.config = config
        self.fused_update = fused.check_setting(fused_update)
        # Plain objects, which Keras's and TensorFlow's tracking store as
        # they are: no bypass needed.
        self._fused_apply = fused.FusedApply(inner_optimizer)
        self._ledger = unscaling.Ledger()
        self._loss_recorded = False
        self._forward_watch = None  # see kmp.diagnostics.forward_watch
        self._saved = saved_state.SavedState()
        # Created here, like Keras's own `iterations`, so that telemetry can
        # read them (and the trainer's first trace write them) before `build`.
        self._scale = ls.LossScale(config, self._state_variable)
        self._overflow = overflow_lib.OverflowRecord(self._state_variable)
        # The losses of the applied steps; its variables come last in build.
        self._applied_loss = applied_loss_lib.AppliedLoss()

    def __repr__(self) -> str:
        inner = type(self.inner_optimizer).__name__
        if self.config.mode == ls_config.NONE:
            return f"<kmp.LossScaleOptimizer mode=none (no scaling) inner={inner}>"
        return (
            f"<kmp.LossScaleOptimizer mode={self.config.mode} "
            f"initial_scale={self.config.initial_scale} inner={inner}>"
        )

    @property
    def mode(self) -> str:
        """`'dynamic'`, `'static'` or `'none'` (no scaling)."""
        return self.config.mode

    # --- state ----------------------------------------------------------

    def _make_variable(self, name: str, dtype: str, value: Any, shape=()):
        return self.add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            # Every replica computes the same value (decisions are agreed on
            # across replicas first), so the first replica's write stands.
            aggregation="only_first_replica",
            name=name,
        )

    def _state_variable(self, name: str, dtype: str, value: Any, shape=()):
        """A variable that is state: saved by name."""
        return self._saved.add(name, self._make_variable(name, dtype, value, shape))

    def build(self, var_list):
        """Creates the optimizer's variables for `var_list`, under its name
        scope, as its first `apply` does. `fit` builds it before the first
        step of Keras's own `train_step`. A custom loop may build it eagerly
        before its `tf.function` step, which is then traced once."""
        distribute.check_build(self.inner_optimizer)
        # An explicit fused_update=True under a strategy fails here, before
        # any collective is traced (apply checks again for custom loops).
        fused.resolve(self.fused_update)
        with keras.name_scope(self.name, caller=self):
            self._overflow.build(var_list)
            self.inner_optimizer.build(var_list)
            keras.optimizers.Optimizer.build(self, var_list)
            self._applied_loss.build(self._make_variable)

    @property
    def loss_scale(self) -> Any:
        """The current loss scale as a float32 scalar tensor (1.0 in mode
        `'none'`). `float()` of it works under a distribution strategy too,
        where the variable (`dynamic_scale`) refuses it."""
        return distribute.value(self._scale.value)

    @property
    def dynamic_scale(self) -> keras.Variable:
        """The loss-scale variable, under Keras's own name for it."""
        return self._scale.value

    @property
    def skipped_steps_total(self) -> keras.Variable:
        """Steps skipped because of non-finite gradients, in total."""
        return self._scale.state.skipped_total

    @property
    def consecutive_skips(self) -> keras.Variable:
        """Steps skipped in a row, up to and including the last one."""
        return self._scale.state.consecutive_skips

    @property
    def good_steps(self) -> keras.Variable:
        """Finite steps since the scale last changed."""
        return self._scale.state.good_steps

    @property
    def hysteresis_left(self) -> keras.Variable:
        """Overflows still tolerated before the next backoff."""
        return self._scale.state.hysteresis_left

    @property
    def last_step_finite(self) -> keras.Variable:
        """Whether the last step's gradients were finite (it was applied)."""
        return self._scale.state.last_finite

    @property
    def overflow_record(self) -> overflow_lib.OverflowRecord:
        """Where steps overflowed. For the last skipped step: per variable,
        whether its gradient was finite (`flags`, in build order, for
        `variables`), and whether its loss was (`loss_finite`). For the last
        step: whether its loss was finite (`last_loss_finite`)."""
        return self._overflow

    # --- scaling ----------------------------------------------------------

    def scale_loss(self, loss):
        """Returns `loss * scale`; Keras's trainer calls it inside `fit`.
        Hand its gradients to `apply(grads, variables)`, which unscales them.

        Takes a tensor or a Python number. A 16-bit loss is cast to float32
        first, since a scaled float16 loss overflows; a warning says once
        that it was computed in 16-bit. Refused inside a recording
        `kmp.ScaledGradientTape`, which scales the loss itself.
        """
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            loss = keras.ops.convert_to_tensor(float(loss), "float32")  # as Keras's
        loss = keras.ops.convert_to_tensor(loss)
        if ls.check_loss(loss, self.mode, self):
            loss = keras.ops.cast(loss, "float32")
        self._ledger.scaled_loss()
        if keras.backend.backend() != "jax":
            # On JAX this runs inside jax.value_and_grad, where no variable
            # may be assigned.
            self._record_loss(loss, in_scale_loss=True)
            self._applied_loss.record(loss)
        return self._scale.scale(loss)

    def _record_loss(self, loss, in_scale_loss: bool = False) -> None:
        """Records whether `loss` (before scaling) is finite, agreed on across
        replicas (`overflow_record.last_loss_finite`), and shows it to a forward
        watch."""
        self._loss_recorded = True
        finite = distribute.agree(keras.ops.all(keras.ops.isfinite(loss)))
        self._overflow.record_loss(finite)
        if self._forward_watch is not None:
            self._forward_watch.saw(loss, finite, in_scale_loss)

    def _unscale(self, grads, variables=None) -> list:
        """The gradients of a scaled loss divided by the scale (in float32),
        recorded as handed out unscaled."""
        unscaled = self._scale.unscale(list(grads), variables)
        self._ledger.handed_out()
        return unscaled

    # --- applying ----------------------------------------------------------

    def apply(self, grads, trainable_variables=None, *, scaled: bool | None = None):
        """Applies `grads` with the inner optimizer only if all are finite,
        and moves the scale.

        Args:
            grads: The gradients, one per variable (or `None`).
            trainable_variables: Their variables (needed on the first call).
            scaled: `True`: the gradients of `scale_loss(loss)`, unscaled
                here. `False`: unscaled gradients (a `ScaledGradientTape`'s,
                or those of a loss never scaled), applied as they are.
                `None`: as the class docstring says.

        Returns:
            A scalar bool tensor: whether the step was applied.

        Raises:
            kmp.LossScaleError: where `scaled` is not given and kmp cannot
                tell (see the class docstring).
        """
        if scaled is not None and not isinstance(scaled, bool):
            raise TypeError(
                f"scaled must be True, False or None. Received: {scaled!r}."
            )
        grads = list(grads)
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "The first apply() needs trainable_variables to build the "
                    "optimizer: optimizer.apply(grads, model.trainable_variables)."
                )
            self.build(list(trainable_variables))
        fused.resolve(self.fused_update)  # raises for True under a strategy
        variables = (
            keras_private.optimizer_variables(self)
            if trainable_variables is None
            else list(trainable_variables)
        )
        if keras.backend.backend() != "jax":
            # On JAX this runs while the step is traced, on no values: kmp's
            # train function checks before the first step.
            lora.warn_dead_adapters(self, variables)
        applies.applied(self)
        apply_inner = self._apply_inner
        if keras.backend.backend() == "jax" and self.config.min_scale >= 1:
            # As Keras's wrapper does: the scaled gradients are checked, and
            # unscaled inside the applied step, where XLA fuses the division
            # with the update. Exact for scales of 1 and up: unscaling them
            # never makes a finite gradient overflow.
            decision = self._ledger.decide(
                grads, scaled, self._contract, self._scale.value, self._scale.scaling
            )
            if decision == unscaling.SCALED and self._scale.scaling:
                apply_inner = functools.partial(self._apply_inner, unscale=True)
        else:
            grads = self._ledger.unscaled(
                grads,
                variables,
                scaled=scaled,
                contract=self._contract,
                scale=self._scale,
                owner=self,
            )
        # One flag per gradient, agreed on across replicas: a non-finite value
        # on any replica makes every replica skip the step.
        flags = distribute.agree(finite_lib.finite_flags(grads))
        finite = keras.ops.all(flags)
        if keras.backend.backend() == "jax":
            # Under jit the check is global: a sharded gradient's reduction
            # reads every device, so each device makes the same decision.
            step_if_finite = functools.partial(
                jax_step.step_if_finite, state=self.variables
            )
        else:
            step_if_finite = distribute.step_if_finite
        applied = step_if_finite(
            finite,
            apply_inner,
            grads,
            variables,
            self._adjust,
            on_skip=self._overflow.record,
            record=self._overflow.by_variable(flags, variables),
        )
        self._applied_loss.settle(finite)
        self._ledger.applied()
        return applied

    def _adjust(self, finite) -> None:
        """Moves the scale after a step: `kmp.scaling.state.next_state`. A
        forward watch may keep it where the loss itself was inf/NaN."""
        watch = self._forward_watch
        if watch is None or not watch.keeps_scale:
            self._scale.adjust(finite)
            return
        forward = keras.ops.logical_not(
            keras.ops.convert_to_tensor(self._overflow.last_loss_finite)
        )
        self._scale.adjust(finite, keep_scale=forward)

    def _apply_inner(self, grads, variables, unscale: bool = False) -> None:
        """The inner optimizer's update, fused by XLA where that is on, of
        `grads` divided by the scale first with `unscale`."""
        if unscale:
            grads = self._scale.unscale(grads, variables)
        if fused.resolve(self.fused_update, self.inner_optimizer, variables):
            self._fused_apply(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)

    def apply_gradients(self, grads_and_vars, *, scaled: bool | None = None):
        """`apply` for `(gradient, variable)` pairs (what `fit` calls)."""
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        return self.apply(grads, trainable_variables, scaled=scaled)

    def stateless_apply(
        self,
        optimizer_variables,
        grads,
        trainable_variables,
        *,
        scaled: bool | None = None,
    ):
        """`apply` without side effects, for JAX: takes the values of
        `self.variables` and of the trainable variables, and returns their
        new values (`(trainable_values, optimizer_values)`), as Keras's
        optimizers do. `fit` calls it inside its jitted step.

        The gradients are those of `scale_loss(loss)` (Keras's contract),
        unscaled here, where `scale_loss` ran since the last apply (while JAX
        traced the same step). A step whose gradients hold inf/NaN returns
        the weights, slots and `iterations` as they were, and moves the
        scale.

        Args:
            optimizer_variables: The values of `self.variables`.
            grads: The gradients, one per trainable variable.
            trainable_variables: The values of the variables it was built
                for.
            scaled: As in `apply`. Say `scaled=True` where the loss was
                scaled in another traced function (a jitted gradient
                function called apart).

        Raises:
            kmp.LossScaleError: where `scaled` is not given, no loss was
                scaled since the last apply, and the mode scales.
        """
        if keras.backend.backend() != "jax":
            raise NotImplementedError(
                "stateless_apply is for the JAX backend; on "
                f"{keras.backend.backend()} call apply(grads, variables)."
            )
        if not self.built:
            raise ValueError(
                "stateless_apply needs a built optimizer: "
                "optimizer.build(model.trainable_variables) first."
            )
        trainable = keras_private.optimizer_variables(self)
        # As Keras's own Optimizer.stateless_apply, with `scaled` passed on.
        mapping = [
            *zip(trainable, trainable_variables, strict=True),
            *zip(self.variables, optimizer_variables, strict=True),
        ]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.apply(grads, scaled=scaled)
        return (
            [scope.get_current_value(v) for v in trainable],
            [scope.get_current_value(v) for v in self.variables],
        )

    # --- saving ---------------------------------------------------------------

    def save_own_variables(self, store) -> None:
        """Saves kmp's state by name. Keras saves the inner optimizer's
        variables, as anywhere."""
        self._saved.save(store)

    def load_own_variables(self, store) -> None:
        """Restores what `save_own_variables` saved, by name."""
        # Files saved by position predate the applied-loss variables.
        later = {id(v) for v in self._applied_loss.variables()}
        by_position = [v for v in self.variables if id(v) not in later]
        self._saved.load(self, by_position, store)

    def get_config(self) -> dict[str, Any]:
        config = self.config.get_config()
        # Omitted when None, so that older kmp versions can read the config.
        if self.fused_update is not None:
            config["fused_update"] = self.fused_update
        config["name"] = self.name
        config["inner_optimizer"] = keras.saving.serialize_keras_object(
            self.inner_optimizer
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if "growth_interval" in config:  # kmp's earlier name for it
            config["dynamic_growth_steps"] = config.pop("growth_interval")
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


def of_model(model: Any) -> LossScaleOptimizer | None:
    """The model's optimizer if it is a `kmp.LossScaleOptimizer`, else None."""
    opt = getattr(model, "optimizer", None)
    return opt if isinstance(opt, LossScaleOptimizer) else None
