"""`kmp.LossScaleOptimizer`: dynamic (or static) loss scaling around any Keras
optimizer, inside `model.fit` and in custom loops; and, under every policy,
no step whose gradients are inf/NaN.

It subclasses `keras.optimizers.LossScaleOptimizer` so that Keras's `compile`
recognises it and never wraps it a second time. It is a composition of
kmp's parts, each in a module of its own: the loss scale (`kmp.scaling.loss_scale`),
whether the gradients handed to `apply` are scaled (`kmp.scaling.unscaling`), the
overflow record (`kmp.scaling.overflow`), the agreement between replicas
(`kmp.distribute`), the fused update (`kmp.fused`), the losses of applied
steps (`kmp.scaling.applied_loss`) and the saved state (`kmp.scaling.saved_state`).
tf.keras 2's contract lives in `kmp.mixed_precision`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from kmp._base import warn as _warn
from kmp.backend import distribute
from kmp.backend import finite as finite_lib
from kmp.backend import fused
from kmp.internals import keras_private
from kmp.scaling import applied_loss as applied_loss_lib
from kmp.scaling import config as ls_config
from kmp.scaling import lora
from kmp.scaling import loss_scale as ls
from kmp.scaling import overflow as overflow_lib
from kmp.scaling import saved_state
from kmp.scaling import unscaling

logger = logging.getLogger("kmp")

_INNER_ONLY_ARGS = (
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "weight_decay",
    "use_ema",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)
_DEFAULT = ls_config.LossScaleConfig()

# The lists `applies_recorded` has open in each thread: each collects the
# loss-scale optimizers whose `apply` runs (traced or eagerly) in that
# thread while it is open.
_recording = threading.local()


@contextlib.contextmanager
def applies_recorded() -> Iterator[list]:
    """Collects every `LossScaleOptimizer` whose `apply` runs (traced or
    eagerly) in this thread inside the block, once each: kmp's train
    function reads which ones a model's first step applied. (A
    `tf.distribute` strategy that runs its replicas in threads of its own
    applies there: nothing is collected.)

    Yields:
        The list the optimizers are collected in.
    """
    applied: list = []
    stack = _recording.__dict__.setdefault("stack", [])
    stack.append(applied)
    try:
        yield applied
    finally:
        # By identity: two lists that hold the same optimizers are equal.
        del stack[next(i for i, a in enumerate(stack) if a is applied)]


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Scales the loss so that small float16 gradients survive, and skips the
    steps whose gradients overflow.

    Each step: the loss is multiplied by the scale, the gradients are divided
    by it (in float32) and checked for inf/NaN, one flag per tensor reduced
    to one decision, in the same pass; only finite steps reach the inner
    optimizer (a skipped step changes no weight, no slot and not
    `iterations`); then the scale moves as `kmp.LossScaleConfig` describes.
    Clipping set on the inner optimizer acts on the unscaled gradients.

    Whether the gradients handed to `apply` are scaled is stated, never
    guessed (`kmp.scaling.unscaling`):

        you hand over                 call                        kmp
        ----------------------------  --------------------------  ------------
        the gradients of              apply(grads, vars) or       unscales them
        scale_loss(loss): fit,        apply_gradients(pairs);
        Keras 3 custom loops          scaled=True says it
        those of ScaledGradientTape,  apply(grads, vars,          applies them
        of get_unscaled_gradients,    scaled=False)               as they are
        or of a loss never scaled
        those of a traced custom      apply(grads, vars)          as they are
        train_step that never calls                               (read from the
        scale_loss                                                trace), warns
        tf.keras 2's three calls      kmp.mixed_precision         as they are
                                      .LossScaleOptimizer's
                                      apply_gradients

    Where kmp cannot tell, it asks (`kmp.LossScaleError`, naming `scaled=`):
    unscaled gradients handed out in the same step passed without
    `scaled=False`; an eager `apply` with no loss scaled since the last one;
    once the optimizer has handed out unscaled gradients, any `apply` with
    no loss scaled in its step. So is scaling a loss inside a recording
    `ScaledGradientTape`.

    With `mode='none'` nothing is scaled, but a step whose gradients are
    inf/NaN is still skipped and counted: `kmp.compile` uses it for models
    that compute in bfloat16 or float32.

    With `gradient_accumulation_steps=N` on the inner optimizer, Keras
    accumulates as it does without kmp (the same learning-rate schedule,
    EMA and `iterations`); a micro-batch whose gradients overflow is skipped
    alone, so a window closes after N applied micro-batches, and the scale
    moves after each micro-batch.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap (an
            instance or a name such as `"adam"`).
        initial_scale: See `kmp.LossScaleConfig` (as for the next six: any
            real number type, Python, numpy or TensorFlow scalars).
        growth_factor: See `kmp.LossScaleConfig`.
        backoff_factor: See `kmp.LossScaleConfig`.
        growth_interval: See `kmp.LossScaleConfig`.
        min_scale: See `kmp.LossScaleConfig`.
        max_scale: See `kmp.LossScaleConfig`.
        hysteresis: See `kmp.LossScaleConfig`.
        mode: `'dynamic'` (default), `'static'` (fixed scale) or `'none'` (no
            scaling; non-finite steps still skipped).
        fused_update: Whether the inner optimizer's update runs as one XLA
            program (`kmp.fused`): the same formulas, with the elementwise
            passes over the float32 weights fused. `None` (default) fuses
            the Keras optimizer classes in `kmp.fused.TESTED` on machines
            without GPUs or TPUs, for updates of at least
            `kmp.fused.MIN_WEIGHTS` weights, outside tf.distribute
            strategies; `True` or `False` force it (`True` also fuses other
            classes, such as your own, and small updates).
        name: The optimizer's name.
        dynamic_growth_steps: Keras's name for `growth_interval`.

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
    contract = unscaling.SCALED

    def __init__(
        self,
        inner_optimizer: Any,
        initial_scale: float = _DEFAULT.initial_scale,
        growth_factor: float = _DEFAULT.growth_factor,
        backoff_factor: float = _DEFAULT.backoff_factor,
        growth_interval: int = _DEFAULT.growth_interval,
        min_scale: float = _DEFAULT.min_scale,
        max_scale: float = _DEFAULT.max_scale,
        hysteresis: int = _DEFAULT.hysteresis,
        mode: str | None = None,
        fused_update: bool | None = None,
        name: str | None = None,
        dynamic_growth_steps: int | None = None,
        **kwargs: Any,
    ):
        inner_optimizer = _checked_inner(inner_optimizer, kwargs)
        if dynamic_growth_steps is not None:
            if growth_interval not in (_DEFAULT.growth_interval, dynamic_growth_steps):
                raise ValueError(
                    "growth_interval and dynamic_growth_steps (Keras's name for "
                    f"it) disagree: {growth_interval} and {dynamic_growth_steps}. "
                    "Pass one of them."
                )
            growth_interval = dynamic_growth_steps
        config = ls_config.LossScaleConfig(
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            mode=ls_config.DYNAMIC if mode is None else mode,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=config.initial_scale,
            dynamic_growth_steps=config.growth_interval,
            name=name,
        )
        self.config = config
        self.fused_update = fused.check_setting(fused_update)
        # Not tracked: these hold tf.functions and Python bookkeeping.
        object.__setattr__(self, "_fused_apply", fused.FusedApply(inner_optimizer))
        object.__setattr__(self, "_ledger", unscaling.Ledger())
        object.__setattr__(self, "_warned", set())
        object.__setattr__(self, "_state_variables", {})
        # Created here, like Keras's own `iterations`, so that telemetry can
        # read them (and the trainer's first trace write them) before `build`.
        object.__setattr__(self, "_scale", ls.LossScale(config, self._state_variable))
        object.__setattr__(
            self, "_overflow", overflow_lib.OverflowRecord(self._state_variable)
        )
        # The losses of the applied steps, for `applied_loss` in fit's logs;
        # its variables come last in build.
        object.__setattr__(self, "_applied_loss", applied_loss_lib.AppliedLoss())
        # Set by kmp.callbacks.OverflowHealer (`watch_forward`).
        object.__setattr__(self, "_forward_probe", None)
        object.__setattr__(self, "_forward_keeps_scale", False)
        object.__setattr__(self, "_forward_counter", None)
        object.__setattr__(self, "_forward_lease", False)
        object.__setattr__(self, "_loss_recorded", False)

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
        variable = self.add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            # Every replica computes the same value (decisions are agreed on
            # across replicas first), so the first replica's write stands.
            aggregation="only_first_replica",
            name=name,
        )
        # Bypass Keras's attribute tracking: add_variable already tracked it.
        object.__setattr__(self, f"_{name}", variable)
        return variable

    def _state_variable(self, name: str, dtype: str, value: Any, shape=()):
        """A variable that is state: saved by name."""
        variable = self._make_variable(name, dtype, value, shape)
        self._state_variables[name] = variable
        return variable

    def build(self, var_list):
        if distribute.in_multi_replica_context():
            raise RuntimeError(
                "kmp.LossScaleOptimizer is being built inside strategy.run, once "
                "per replica, which cannot create one set of variables. Build it "
                "before the first strategy.run, inside strategy.scope(): "
                "optimizer.build(model.trainable_variables) (Keras's own "
                "LossScaleOptimizer needs the same)."
            )
        # An explicit fused_update=True under a strategy fails here, before
        # any collective is traced (apply checks again for custom loops).
        fused.resolve(self.fused_update)
        strategy = tf.distribute.get_strategy()
        if self.inner_optimizer.gradient_accumulation_steps and (
            strategy.num_replicas_in_sync > 1
        ):
            raise NotImplementedError(
                "Keras's gradient accumulation does not run under "
                f"{type(strategy).__name__} with more than one replica (its "
                "update sits in a condition, where the replicas' gradients "
                "cannot be all-reduced; plain Keras fails there too). Use a "
                "larger global batch instead of gradient_accumulation_steps, "
                "or train on one device."
            )
        self._overflow.build(var_list)
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)
        self._applied_loss.build(self._make_variable)

    @property
    def loss_scale(self) -> tf.Tensor:
        """The current loss scale as a float32 scalar tensor (1.0 in mode
        `'none'`), as tf.keras 2's `loss_scale` was: `float()` of it works
        also under a distribution strategy. The variable is
        `dynamic_scale`."""
        return tf.convert_to_tensor(self._scale.value)

    @property
    def dynamic_scale(self) -> keras.Variable:
        """The loss-scale variable, the name Keras's own wrapper uses."""
        return self._scale.value

    @property
    def loss_scale_object(self) -> ls.LossScale:
        """The `kmp.scaling.loss_scale.LossScale` this optimizer scales with."""
        return self._scale

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
    def last_loss_finite(self) -> keras.Variable:
        """Whether the last loss (before scaling) was finite. False means the
        forward pass itself overflowed, not the gradients."""
        return self._overflow.last_loss_finite

    @property
    def overflow_record(self) -> overflow_lib.OverflowRecord:
        """The record of the last skipped step (`kmp.scaling.overflow`): per
        variable flags (`overflow_record.flags`) and whether its loss was
        finite (`overflow_record.loss_finite`)."""
        return self._overflow

    @property
    def overflow_loss_finite(self) -> keras.Variable:
        """Whether the loss was finite at the last skipped step."""
        return self._overflow.loss_finite

    @property
    def overflow_flags(self) -> keras.Variable:
        """Per trainable variable (in build order): False where the last
        skipped step's gradient held inf/NaN. See `kmp.debug.last_overflow`."""
        return self._overflow.flags

    @property
    def applied_loss(self) -> applied_loss_lib.AppliedLoss:
        """The losses of the steps applied since telemetry's last epoch start
        (`kmp.scaling.applied_loss`)."""
        return self._applied_loss

    # tf.keras 2's names, which its code reads.
    @property
    def dynamic(self) -> bool:
        """Whether the scale moves (mode `'dynamic'`)."""
        return self.config.mode == ls_config.DYNAMIC

    @property
    def dynamic_counter(self) -> keras.Variable | None:
        """`good_steps` (`None` unless `dynamic`)."""
        return self.good_steps if self.dynamic else None

    def took_step(self) -> bool:
        """Whether this optimizer applied a step in the current step context
        (the graph being traced, or eagerly) since the last call: a training
        step. Telemetry reports only there, so evaluation is unchanged."""
        return self._ledger.took_step()

    # --- scaling ----------------------------------------------------------

    def record_loss(self, loss) -> None:
        """Records whether `loss` (before scaling) is finite, agreed on across
        replicas (`last_loss_finite`; `scale_loss` and the tape call it)."""
        object.__setattr__(self, "_loss_recorded", True)
        finite = distribute.agree(tf.reduce_all(tf.math.is_finite(loss)))
        self._overflow.record_loss(finite)
        if self._forward_counter is not None:
            self._forward_counter.assign_add(
                tf.cast(tf.logical_not(finite), self._forward_counter.dtype)
            )

    def scale_loss(self, loss):
        """Returns `loss * scale` (Keras's trainer calls this inside `fit`).
        Its gradients go to `apply(grads, variables)`, which unscales them.

        Accepts a tensor or a Python number. A 16-bit loss is cast to
        float32 first (a scaled float16 loss overflows), with a warning
        once: it was still computed in 16-bit. Refuses a loss scaled inside
        a recording `kmp.ScaledGradientTape` (which scales it already).
        """
        return self._scaled(loss)

    def _scaled(self, loss):
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            loss = tf.constant(loss, "float32")  # Keras's wrapper accepts numbers
        loss = tf.convert_to_tensor(loss)
        if ls.check_loss(loss, self.mode):
            self.note_sixteen_bit_loss(loss)
            loss = tf.cast(loss, "float32")
        self._ledger.scaled_loss()
        self.record_loss(loss)
        if self._forward_probe is not None and not tf.executing_eagerly():
            self._forward_probe(loss)
        self._applied_loss.record(loss)
        return self._scale.scale(loss)

    @property
    def loss_recorded(self) -> bool:
        """Whether a step has recorded its loss's finiteness here
        (`scale_loss`, or a `kmp.ScaledGradientTape`): a `train_step` that
        calls neither leaves `last_loss_finite` unwritten."""
        return self._loss_recorded

    def watch_forward(
        self,
        probe: Callable[[Any], None] | None,
        keeps_scale: bool,
        counter: tf.Variable | None = None,
    ) -> None:
        """How the steps traced from now on treat the forward pass
        (`kmp.callbacks.OverflowHealer` sets it, then has the step traced
        again).

        A watch holds for one call of the train function at a time: whoever
        sets it renews it after each call (`renew_forward_watch`), and kmp's
        train function ends one that was not renewed (`forward_watch_lapsed`:
        the `fit` that set it was interrupted, or a callback raised), so that
        a later `fit` trains as it would without it.

        Args:
            probe: Called with the loss when `scale_loss` is traced, in the
                step's graph (the forward pass's ops are there), or None.
            keeps_scale: Whether a step whose loss itself is inf/NaN (a
                forward overflow, which a lower scale cannot fix) leaves the
                loss scale as it is; it is skipped and counted either way.
            counter: An int64 `tf.Variable` to which each step whose loss is
                inf/NaN adds one (a call of the train function may run several
                steps: `steps_per_execution`), or None.
        """
        object.__setattr__(self, "_forward_probe", probe)
        object.__setattr__(self, "_forward_keeps_scale", bool(keeps_scale))
        object.__setattr__(self, "_forward_counter", counter)
        object.__setattr__(self, "_forward_lease", self._forward_watched())

    def _forward_watched(self) -> bool:
        return (
            self._forward_probe is not None
            or self._forward_keeps_scale
            or self._forward_counter is not None
        )

    def renew_forward_watch(self) -> None:
        """Has the watch set by `watch_forward` hold for the next call of the
        train function too."""
        object.__setattr__(self, "_forward_lease", self._forward_watched())

    def forward_watch_lapsed(self) -> bool:
        """Called by kmp's train function before each call. Takes the watch's
        lease for this call; where it was not renewed since the last call,
        ends the watch and returns True: the step must be traced again."""
        if not self._forward_watched():
            return False
        if self._forward_lease:
            object.__setattr__(self, "_forward_lease", False)
            return False
        self.watch_forward(None, keeps_scale=False)
        return True

    def get_scaled_loss(self, loss):
        """tf.keras 2's spelling: `loss * scale`. Given a callable that
        returns the loss, returns a callable that returns the scaled loss,
        as tf.keras 2 did."""
        if callable(loss):
            return lambda: self._scaled(loss())
        return self._scaled(loss)

    def get_unscaled_gradients(self, grads, variables=None):
        """Returns `grads / scale`: the unscaled gradients of a scaled loss,
        to clip, log or apply. Apply them with `apply(grads, variables,
        scaled=False)` (tf.keras 2's `kmp.mixed_precision.LossScaleOptimizer`
        takes them in `apply_gradients`).

        Args:
            grads: Gradients of a scaled loss.
            variables: Optional, their variables, so that Keras's
                overwrite-with-gradient variables (float8 scales) are left
                alone.
        """
        return self.unscale(grads, variables)

    def unscale(self, grads, variables=None) -> list:
        """The gradients of a scaled loss divided by the scale (in float32),
        recorded as handed out unscaled (`kmp.ScaledGradientTape` calls it)."""
        unscaled = self._scale.unscale(list(grads), variables)
        self._ledger.handed_out()
        return unscaled

    def tape_recording(self, entered: bool) -> None:
        """A `kmp.ScaledGradientTape` of this optimizer started (or stopped)
        recording in the current step context."""
        if entered:
            self._ledger.tape_entered()
        else:
            self._ledger.tape_exited()

    # --- applying ----------------------------------------------------------

    def apply(self, grads, trainable_variables=None, *, scaled: bool | None = None):
        """Applies `grads` with the inner optimizer only if all are finite,
        and moves the scale.

        Args:
            grads: The gradients, one per variable (or `None`).
            trainable_variables: Their variables (needed on the first call).
            scaled: `True`: the gradients of `scale_loss(loss)`, unscaled
                here; `False`: unscaled gradients (a `ScaledGradientTape`'s,
                `get_unscaled_gradients`', or a loss never scaled), applied as
                they are; `None`: the optimizer's contract (see the class
                docstring).

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
            self.build_for_apply(trainable_variables)
        fused.resolve(self.fused_update)  # raises for True under a strategy
        variables = (
            keras_private.optimizer_variables(self)
            if trainable_variables is None
            else list(trainable_variables)
        )
        if "adapters" not in self._warned:
            self._warned.add("adapters")
            lora.warn_dead_adapters(variables)
        for applied in getattr(_recording, "stack", ()):
            if not any(o is self for o in applied):
                applied.append(self)
        grads = self._as_unscaled(grads, variables, scaled)
        # One flag per gradient, agreed on across replicas: a non-finite value
        # on any replica makes every replica skip the step.
        flags = distribute.agree(finite_lib.finite_flags(grads))
        finite = tf.reduce_all(flags)
        applied = distribute.step_if_finite(
            finite,
            self._apply_inner,
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
        """The loss-scale state update after a step (see `watch_forward`)."""
        if not self._forward_keeps_scale:
            self._scale.adjust(finite)
            return
        forward = tf.logical_not(
            keras.ops.convert_to_tensor(self._overflow.last_loss_finite)
        )
        self._scale.adjust(finite, keep_scale=forward)

    def _as_unscaled(self, grads, variables, scaled):
        """The gradients as the inner optimizer must see them: unscaled."""
        decision = self._ledger.decide(
            grads, scaled, self.contract, self._scale.value, self._scale.scaling
        )
        if not self._scale.scaling:
            return grads
        if decision == unscaling.NEVER_SCALED:
            self._warn_once("never scaled", unscaling.NEVER_SCALED_WARNING)
        if decision == unscaling.SCALED:
            return self._scale.unscale(grads, variables)
        return grads

    def note_sixteen_bit_loss(self, loss) -> None:
        """Warns once that a 16-bit loss is scaled (`SIXTEEN_BIT_LOSS`)."""
        self._warn_once(
            "16-bit loss", ls.SIXTEEN_BIT_LOSS.format(dtype=loss.dtype.name)
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        _warn.warn(message)

    def compile_update_ahead(self, trainable_variables: Any) -> bool:
        """Compiles the fused update of `trainable_variables` now, before
        the first step that applies it, where this optimizer fuses that
        update (`fused_update`); it builds the optimizer for them first if
        it is not built (as the first `apply` would), and updates nothing.
        Returns whether it compiled. `fit` calls it for Keras's own
        `train_step` (see `kmp.fused.FusedApply.compile_ahead`); a custom
        loop may call it, eagerly, with the variables it applies.
        """
        variables = list(trainable_variables)
        if not (
            variables
            and tf.executing_eagerly()
            and fused.resolve(self.fused_update, self.inner_optimizer, variables)
        ):
            return False
        self.build_for_apply(variables)
        return self._fused_apply.compile_ahead(variables)

    def build_for_apply(self, trainable_variables: Any) -> None:
        """Builds the optimizer for `trainable_variables` now, as its first
        `apply` would (its state's variables are named under the
        optimizer's scope, as there), unless it is built.

        `fit` calls it before the first step of Keras's own `train_step`:
        a `tf.function` whose first trace creates variables is traced a
        second time without them, so a step that builds its optimizer (as
        plain Keras's first step does) is traced twice. A custom loop may
        call it, eagerly, before its `tf.function` step, for the same
        reason.

        Example:

        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam())
        >>> optimizer.build_for_apply(model.trainable_variables)
        >>> optimizer.built, int(optimizer.iterations)
        (True, 0)
        """
        if self.built:
            return
        with keras.name_scope(self.name, caller=self):
            self.build(list(trainable_variables))
        self.built = True

    def _apply_inner(self, grads, variables) -> None:
        """The inner optimizer's update, fused by XLA where that is on."""
        if fused.resolve(self.fused_update, self.inner_optimizer, variables):
            self._fused_apply(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)

    def apply_gradients(self, grads_and_vars, *, scaled: bool | None = None):
        """`apply` for `(gradient, variable)` pairs (what `fit` calls)."""
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        return self.apply(grads, trainable_variables, scaled=scaled)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "kmp runs on the TensorFlow backend, which applies gradients "
            "statefully; stateless_apply is for JAX."
        )

    # --- saving ---------------------------------------------------------------

    def save_own_variables(self, store) -> None:
        """Saves kmp's state by name (`kmp.scaling.saved_state`); the inner
        optimizer's variables are saved by Keras, as anywhere."""
        saved_state.save(self._state_variables, store)

    def load_own_variables(self, store) -> None:
        """Restores what `save_own_variables` saved (`kmp.scaling.saved_state`)."""
        # Files saved by position predate the applied-loss variables.
        later = {id(v) for v in self._applied_loss.variables()}
        by_position = [v for v in self.variables if id(v) not in later]
        saved_state.load(self, self._state_variables, by_position, store)

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
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


def of_model(model: Any) -> LossScaleOptimizer | None:
    """The model's optimizer if it is a `kmp.LossScaleOptimizer`, else None."""
    opt = getattr(model, "optimizer", None)
    return opt if isinstance(opt, LossScaleOptimizer) else None


def _checked_inner(inner_optimizer: Any, kwargs: dict) -> Any:
    """The inner optimizer, once the wrapper's arguments are checked."""
    bad = [
        k for k in kwargs if k in _INNER_ONLY_ARGS and kwargs[k] not in (None, False)
    ]
    if bad:
        raise ValueError(
            f"LossScaleOptimizer does not take {', '.join(bad)}: it would act "
            "on scaled gradients. Set it on the inner optimizer instead, "
            f"e.g. keras.optimizers.Adam({bad[0]}=...), which kmp feeds "
            "unscaled gradients."
        )
    unknown = [k for k in kwargs if k not in _INNER_ONLY_ARGS]
    if unknown:
        raise TypeError(
            f"LossScaleOptimizer got unexpected arguments: {', '.join(unknown)}. "
            "It takes inner_optimizer, initial_scale, growth_factor, "
            "backoff_factor, growth_interval (or dynamic_growth_steps), "
            "min_scale, max_scale, hysteresis, mode, fused_update and name; "
            "optimizer settings belong on the inner optimizer."
        )
    if isinstance(inner_optimizer, str):
        inner_optimizer = keras.optimizers.get(inner_optimizer)
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"inner_optimizer is already a loss-scale optimizer "
            f"({type(inner_optimizer).__name__}); wrapping it again would "
            "scale the loss twice. Pass its inner optimizer instead: "
            "kmp.LossScaleOptimizer(opt.inner_optimizer)."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "inner_optimizer must be a keras.optimizers.Optimizer (such as "
            "keras.optimizers.Adam()) or an optimizer name such as 'adam'. "
            f"Received: {inner_optimizer!r} (of type "
            f"{type(inner_optimizer).__name__})."
        )
    return inner_optimizer
