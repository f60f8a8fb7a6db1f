"""`kmp.LossScaleOptimizer`: dynamic (or static) loss scaling around any Keras
optimizer, inside `model.fit` and in custom loops; and, under every policy,
no step whose gradients are inf/NaN.

It subclasses `keras.optimizers.LossScaleOptimizer` so that Keras's `compile`
recognises it and never wraps it a second time. It is a composition of
kmp's parts, each in a module of its own: the loss scale (`kmp.loss_scale`),
whether incoming gradients are still scaled (`kmp.unscaling`), the overflow
record (`kmp.overflow`), gradient accumulation (`kmp.accumulation`), the
agreement between replicas (`kmp.distribute`) and the fused update
(`kmp.fused`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from kmp import accumulation as accumulation_lib
from kmp import applied_loss as applied_loss_lib
from kmp import distribute
from kmp import fused
from kmp import loss_scale as ls
from kmp import overflow as overflow_lib
from kmp import quantization
from kmp import unscaling

logger = logging.getLogger("kmp")

_CLIPPING_ARGS = (
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "weight_decay",
    "use_ema",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)
# The optimizer's public name for each LossScaleState field.
_PUBLIC_NAME = ls.PUBLIC_NAMES
# The optimizer's loss-scale state, by public name.
STATE_NAMES = tuple(_PUBLIC_NAME.values())
_DEFAULT = ls.LossScaleConfig()
# The version of the saved state's layout (`save_own_variables`): the state
# is found by name. Files without it were saved by position.
SAVE_FORMAT = 2
_FORMAT_KEY = "kmp_format"
_SEPARATOR = "|"  # not "/", which HDF5 reads as a group path


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

    `apply` accepts the gradients of a scaled loss (Keras 3: `fit`, or a
    plain tape on `scale_loss(loss)`), the unscaled gradients of a
    `kmp.ScaledGradientTape` or of `get_unscaled_gradients` (clipped or not),
    and the gradients of a loss no one scaled; it tells them apart by where
    they came from (`kmp.unscaling`), and refuses sequences that would scale
    twice.

    With `mode='none'` nothing is scaled, but a step whose gradients are
    inf/NaN is still skipped and counted: `kmp.compile` uses it for models
    that compute in bfloat16 or float32.

    With `gradient_accumulation_steps=N` on the inner optimizer, an overflow
    anywhere in a window of N micro-batches skips the whole window, and the
    scale's growth interval counts optimizer steps, not micro-batches.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap (an
            instance or a name such as `"adam"`).
        initial_scale, growth_factor, backoff_factor, growth_interval,
        min_scale, max_scale, hysteresis: See `kmp.LossScaleConfig`. Any
            real number type is accepted (Python, numpy, TensorFlow scalars).
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
    >>> bool(opt.apply([tf.constant(float("inf"))], [var]))  # skipped
    False
    >>> float(opt.loss_scale), float(var)
    (512.0, 1.0)
    """

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
        bad = [
            k for k in kwargs if k in _CLIPPING_ARGS and kwargs[k] not in (None, False)
        ]
        if bad:
            raise ValueError(
                f"LossScaleOptimizer does not take {', '.join(bad)}: it would act "
                "on scaled gradients. Set it on the inner optimizer instead, "
                f"e.g. keras.optimizers.Adam({bad[0]}=...), which kmp feeds "
                "unscaled gradients."
            )
        unknown = [k for k in kwargs if k not in _CLIPPING_ARGS]
        if unknown:
            raise TypeError(
                f"LossScaleOptimizer got unexpected arguments: {', '.join(unknown)}. "
                "It takes inner_optimizer, initial_scale, growth_factor, "
                "backoff_factor, growth_interval (or dynamic_growth_steps), "
                "min_scale, max_scale, hysteresis, mode, fused_update and name; "
                "optimizer settings belong on the inner optimizer."
            )
        if dynamic_growth_steps is not None:
            if growth_interval != _DEFAULT.growth_interval and (
                growth_interval != dynamic_growth_steps
            ):
                raise ValueError(
                    "growth_interval and dynamic_growth_steps (Keras's name for "
                    f"it) disagree: {growth_interval} and {dynamic_growth_steps}. "
                    "Pass one of them."
                )
            growth_interval = dynamic_growth_steps
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
        config = ls.LossScaleConfig(
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            mode=ls.DYNAMIC if mode is None else mode,
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
        object.__setattr__(self, "_warned_never_scaled", False)
        object.__setattr__(self, "_warned_unknown_origin", False)
        object.__setattr__(self, "_checked_adapters", False)
        object.__setattr__(self, "_state_variables", {})
        # Gradient accumulation with loss scaling: kmp takes it over from the
        # inner optimizer (kmp.accumulation).
        self.gradient_accumulation_steps_taken = None
        object.__setattr__(self, "_accumulation", None)
        if inner_optimizer.gradient_accumulation_steps:
            if inner_optimizer.built:
                raise ValueError(
                    "The inner optimizer is already built with gradient "
                    "accumulation; wrap it before its first use so that kmp can "
                    "take the accumulation over."
                )
            self.gradient_accumulation_steps_taken = (
                inner_optimizer.gradient_accumulation_steps
            )
            inner_optimizer.gradient_accumulation_steps = None
            object.__setattr__(
                self,
                "_accumulation",
                accumulation_lib.Accumulation(self.gradient_accumulation_steps_taken),
            )
        # Created here, like Keras's own `iterations`, so that telemetry can
        # read them (and the trainer's first trace write them) before `build`.
        object.__setattr__(self, "_scale", ls.LossScale(config, self._state_variable))
        object.__setattr__(
            self, "_overflow", overflow_lib.OverflowRecord(self._state_variable)
        )
        # What the last step context left for apply, at run time: a control
        # value, not state (never saved; see kmp.unscaling).
        self._make_variable("pending_gradients", "int32", unscaling.PENDING_NONE)
        # The losses of the applied steps, for fit's `loss` (kmp.applied_loss);
        # its variables come last in build.
        object.__setattr__(self, "_applied_loss", applied_loss_lib.AppliedLoss())

    def __repr__(self) -> str:
        inner = type(self.inner_optimizer).__name__
        if self.config.mode == ls.NONE:
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
        self._overflow.build(var_list)
        if self._accumulation is not None:
            if tf.distribute.get_strategy().num_replicas_in_sync > 1:
                raise NotImplementedError(
                    "Gradient accumulation with loss scaling is not supported "
                    f"under {type(tf.distribute.get_strategy()).__name__} yet "
                    "(kmp would have to agree on whole windows across replicas). "
                    "Use a larger global batch instead of "
                    "gradient_accumulation_steps, or train on one device."
                )

            def like(reference, name):
                variable = self.add_variable_from_reference(reference, name=name)
                self._state_variables[variable.name] = variable
                return variable

            self._accumulation.build(var_list, self._state_variable, like)
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)
        self._applied_loss.build(self._make_variable)

    @property
    def loss_scale(self) -> keras.Variable:
        """The current loss scale (a float32 variable; 1.0 in mode `'none'`)."""
        return self._scale.value

    @property
    def dynamic_scale(self) -> keras.Variable:
        """Alias of `loss_scale`, the name Keras's own wrapper uses."""
        return self.loss_scale

    @property
    def loss_scale_object(self) -> ls.LossScale:
        """The `kmp.loss_scale.LossScale` this optimizer scales with."""
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
    def dynamic(self) -> bool:
        """tf.keras 2's name: whether the scale moves (mode `'dynamic'`)."""
        return self.config.mode == ls.DYNAMIC

    @property
    def dynamic_counter(self) -> keras.Variable | None:
        """tf.keras 2's name for `good_steps` (`None` unless `dynamic`)."""
        return self.good_steps if self.dynamic else None

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
        """The record of the last skipped step (`kmp.overflow`)."""
        return self._overflow

    @property
    def overflow_loss_finite(self) -> keras.Variable:
        """Whether the loss was finite at the last skipped step (False: that
        step's overflow was in the forward pass)."""
        return self._overflow.loss_finite

    @property
    def overflow_flags(self) -> keras.Variable:
        """Per trainable variable (in build order): False where the last
        skipped step's gradient held inf/NaN. See `kmp.debug.last_overflow`."""
        return self._overflow.flags

    @property
    def applied_loss(self) -> applied_loss_lib.AppliedLoss:
        """The losses of the steps applied since telemetry's last epoch start
        (`kmp.applied_loss`)."""
        return self._applied_loss

    def took_step(self) -> bool:
        """Whether this optimizer applied a step in the current step context
        (the graph being traced, or eagerly) since the last call: a training
        step. Telemetry reports only there, so evaluation is unchanged."""
        return self._ledger.took_step()

    # --- scaling ----------------------------------------------------------

    def record_loss(self, loss) -> None:
        """Records whether `loss` (before scaling) is finite, agreed on across
        replicas (`last_loss_finite`; `scale_loss` and the tape call it)."""
        self._overflow.record_loss(
            distribute.agree(tf.reduce_all(tf.math.is_finite(loss)))
        )

    def scale_loss(self, loss):
        """Returns `loss * scale` (Keras's trainer calls this inside `fit`).

        Accepts a tensor or a Python number; refuses a loss computed in
        float16 (a scaled float16 loss overflows) and a loss scaled inside a
        recording `kmp.ScaledGradientTape` (which scales it already).
        """
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            loss = tf.constant(loss, "float32")  # Keras's wrapper accepts numbers
        loss = tf.convert_to_tensor(loss)
        _check_loss(loss, self.mode)
        self._ledger.scaled_loss()
        self.record_loss(loss)
        self._applied_loss.record(loss)
        self._pending_gradients.assign(unscaling.PENDING_SCALED_LOSS)
        return self._scale.scale(loss)

    def get_scaled_loss(self, loss):
        """tf.keras 2 spelling: returns `loss * scale` (a callable returning
        the loss is called first, as tf.keras 2 allowed).

        Pair it with `get_unscaled_gradients` and `apply_gradients`, as in
        TensorFlow's mixed-precision guide.
        """
        if callable(loss):
            loss = loss()
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads, variables=None):
        """tf.keras 2 spelling: returns `grads / scale`; pass the result
        (clipped as you like) to `apply_gradients` or `apply`, which will not
        unscale it again. Unscaling these once more is an error.

        Args:
            grads: Gradients of a scaled loss.
            variables: Optional, their variables, so that Keras's
                overwrite-with-gradient variables (float8 scales) are left
                alone.
        """
        grads = list(grads)
        unscaled = self._scale.unscale(grads, variables)
        self._ledger.handing_out(grads, unscaled)
        self._pending_gradients.assign(unscaling.PENDING_UNSCALED)
        return unscaled

    def unscaled_from_tape(self, grads, variables):
        """The tape's part: `grads`, computed from a backward pass seeded
        with the scale, unscaled and marked so that `apply` takes them as
        they are. (`kmp.ScaledGradientTape` calls it.)"""
        unscaled = self._scale.unscale(grads, variables)
        self._ledger.handing_out([], unscaled)
        self._pending_gradients.assign(unscaling.PENDING_UNSCALED)
        return unscaled

    def tape_recording(self, entered: bool) -> None:
        """A `kmp.ScaledGradientTape` of this optimizer started (or stopped)
        recording in the current step context."""
        if entered:
            self._ledger.tape_entered()
        else:
            self._ledger.tape_exited()

    # --- applying ----------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Applies `grads` with the inner optimizer only if all are finite,
        unscaling them first if they are the gradients of a scaled loss (see
        the class docstring), and moves the scale.

        Returns:
            A scalar bool tensor: whether the step was applied.
        """
        grads = list(grads)
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "The first apply() needs trainable_variables to build the "
                    "optimizer: optimizer.apply(grads, model.trainable_variables)."
                )
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        fused.resolve(self.fused_update)  # raises for True under a strategy
        variables = (
            self._trainable_variables
            if trainable_variables is None
            else list(trainable_variables)
        )
        if not self._checked_adapters:
            object.__setattr__(self, "_checked_adapters", True)
            self._warn_dead_adapters(variables)
        grads = self._unscale_for_apply(grads, variables)
        # One flag per gradient, agreed on across replicas: a non-finite value
        # on any replica makes every replica skip the step.
        flags = distribute.agree(ls.finite_flags(grads))
        finite = tf.reduce_all(flags)
        by_variable = self._overflow.by_variable(flags, variables)
        if self._accumulation is not None:

            def record_micro_batch():
                self._overflow.record(by_variable)
                return tf.constant(False)

            # A skipped micro-batch is recorded at once; its window closes later.
            tf.cond(finite, lambda: tf.constant(True), record_micro_batch)
            applied = self._accumulation.add(
                grads,
                variables,
                finite,
                lambda mean, window_finite: distribute.step_if_finite(
                    window_finite,
                    self._apply_inner,
                    mean,
                    variables,
                    self._scale.adjust,
                ),
            )
        else:
            applied = distribute.step_if_finite(
                finite,
                self._apply_inner,
                grads,
                variables,
                self._scale.adjust,
                on_skip=self._overflow.record,
                record=by_variable,
            )
        # A micro-batch's gradients are taken when finite, as a step's are.
        self._applied_loss.settle(finite)
        self._ledger.applied()
        return applied

    def _unscale_for_apply(self, grads, variables):
        """The gradients as the inner optimizer must see them: unscaled."""
        decision = self._ledger.decide(grads)
        # Read what another context left before this step clears it.
        pending = tf.convert_to_tensor(self._pending_gradients)
        self._pending_gradients.assign(unscaling.PENDING_NONE)
        if decision == unscaling.AT_RUN_TIME and tf.executing_eagerly():
            left = int(pending.numpy())
            if left == unscaling.PENDING_UNSCALED:
                decision = unscaling.UNSCALED
            else:
                if left == unscaling.PENDING_NONE:
                    self._warn_unknown_origin()
                decision = unscaling.SCALED
        if decision == unscaling.NEVER_SCALED:
            self._warn_never_scaled()
        if not self._scale.scaling:
            return grads
        if decision == unscaling.SCALED:
            return self._scale.unscale(grads, variables)
        if decision == unscaling.AT_RUN_TIME:
            factor = tf.where(
                tf.equal(pending, unscaling.PENDING_UNSCALED),
                tf.constant(1.0),
                1.0 / tf.convert_to_tensor(self.loss_scale),
            )
            return self._scale.unscale(grads, variables, factor)
        return grads

    def _warn_dead_adapters(self, variables) -> None:
        dead = quantization.dead_adapters(variables)
        if not dead:
            return
        warnings.warn(
            f"The LoRA adapters of {', '.join(dead)} are all zero, so they "
            "cannot learn (both factors zero: their gradients are zero). That is what "
            "keras.models.load_model leaves: Keras's .keras format merges the "
            "adapters into the kernel when saving and zeroes them when loading. "
            "To continue LoRA fine-tuning exactly where it stopped, save with "
            "tf.train.Checkpoint(model=model, optimizer=model.optimizer), which "
            "keeps the adapters; to start new adapters on the merged model, "
            "give lora_kernel_a random values: "
            "layer.lora_kernel_a.assign(keras.initializers.HeUniform()("
            "layer.lora_kernel_a.shape)).",
            UserWarning,
            stacklevel=3,
        )

    def _warn_unknown_origin(self) -> None:
        if self._warned_unknown_origin or not self._scale.scaling:
            return
        object.__setattr__(self, "_warned_unknown_origin", True)
        warnings.warn(
            "kmp.LossScaleOptimizer.apply() received gradients eagerly with no "
            "scaled loss recorded since the last apply, so kmp cannot tell "
            "whether they are scaled. It takes them as the gradients of a "
            "scaled loss and unscales them, as Keras's LossScaleOptimizer does: "
            "each update is divided by the loss scale "
            f"({float(self._scale.value):g} now). If the loss was never scaled "
            "(a custom train_step run eagerly, a custom loop), scale it before "
            "taking gradients: loss = optimizer.scale_loss(loss); if you scaled "
            "it by hand, use scale_loss instead.",
            UserWarning,
            stacklevel=3,
        )

    def _warn_never_scaled(self) -> None:
        if self._warned_never_scaled or not self._scale.scaling:
            return
        object.__setattr__(self, "_warned_never_scaled", True)
        warnings.warn(
            "kmp.LossScaleOptimizer.apply() received gradients of a loss that "
            "was never scaled (a custom train_step or loop that does not call "
            "scale_loss). kmp applies them as they are, so the updates have the "
            "right size, but float16 gradients may underflow without scaling. "
            "Scale the loss before taking gradients (also if you multiplied it by "
            "the scale yourself): loss = self.optimizer.scale_loss(loss)",
            UserWarning,
            stacklevel=3,
        )

    def _apply_inner(self, grads, variables) -> None:
        """The inner optimizer's update, fused by XLA where that is on."""
        if fused.resolve(self.fused_update, self.inner_optimizer, variables):
            self._fused_apply(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        return self.apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "kmp runs on the TensorFlow backend, which applies gradients "
            "statefully; stateless_apply is for JAX."
        )

    # --- saving ---------------------------------------------------------------

    def _saved_variables(self) -> dict[str, Any]:
        """name -> variable, for kmp's own state: the loss scale, the
        overflow record, an open accumulation window. Not saved here: control
        values, the wrapper's own unused `iterations` and learning rate, and
        the inner optimizer's variables, which Keras saves as it saves that
        optimizer anywhere (under `optimizer/inner_optimizer` in the file, by
        position with a count check)."""
        saved: dict[str, Any] = {}
        for name, variable in self._state_variables.items():
            key = f"kmp{_SEPARATOR}{name}"
            # Accumulators are named after their model variable's path, which
            # may repeat (two submodels' `proj` layers after load_model).
            n = 1
            while key in saved:
                n += 1
                key = f"kmp{_SEPARATOR}{name}{_SEPARATOR}{n}"
            saved[key] = variable
        return saved

    def save_own_variables(self, store) -> None:
        """Saves kmp's state by name, with the layout's version (Keras saves
        optimizers by position, which restores into the wrong slots when
        the variable list changes)."""
        store[_FORMAT_KEY] = np.asarray(SAVE_FORMAT)
        for key, variable in self._saved_variables().items():
            store[key] = keras.ops.convert_to_numpy(variable)

    def load_own_variables(self, store) -> None:
        """Restores the state saved by `save_own_variables`, by name; an
        older file (saved by position) is read by position, with a warning.
        A value whose shape differs from its variable's is not restored."""
        keys = set(store.keys())
        if _FORMAT_KEY not in keys:
            self._load_by_position(store)
            return
        saved = self._saved_variables()
        found = _match_saved_names(list(saved), sorted(keys - {_FORMAT_KEY}))
        wrong_shape = []
        for key, variable in saved.items():
            if key not in found:
                continue
            value = store[found[key]]
            if tuple(value.shape) != tuple(variable.shape):
                wrong_shape.append(
                    f"{key} (file {tuple(value.shape)}, "
                    f"optimizer {tuple(variable.shape)})"
                )
                continue
            variable.assign(value)
        missing = [k for k in saved if k not in found]
        unknown = sorted(keys - set(found.values()) - {_FORMAT_KEY})
        if missing or unknown or wrong_shape:
            warnings.warn(
                f"kmp.LossScaleOptimizer {self.name!r}: restored the optimizer "
                f"state by name; not in the file (kept at their initial values): "
                f"{', '.join(missing) or 'none'}; in the file but not in this "
                f"optimizer (ignored): {', '.join(unknown) or 'none'}; of "
                f"another shape (kept at their initial values): "
                f"{', '.join(wrong_shape) or 'none'}.",
                UserWarning,
                stacklevel=2,
            )

    def _load_by_position(self, store) -> None:
        # Files saved by position predate the applied-loss variables.
        later = {id(v) for v in self._applied_loss.variables()}
        variables = [v for v in self.variables if id(v) not in later]
        if len(store.keys()) != len(variables):
            warnings.warn(
                f"kmp.LossScaleOptimizer {self.name!r}: the file holds "
                f"{len(store.keys())} optimizer variables saved by position (an "
                f"older kmp), this optimizer has {len(variables)}: the optimizer "
                "state is not restored.",
                UserWarning,
                stacklevel=3,
            )
            return
        warnings.warn(
            f"kmp.LossScaleOptimizer {self.name!r}: restoring optimizer state "
            "saved by position (an older kmp); save again to store it by name.",
            UserWarning,
            stacklevel=3,
        )
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])

    def get_config(self) -> dict[str, Any]:
        config = self.config.get_config()
        # Omitted when None, so that older kmp versions can read the config.
        if self.fused_update is not None:
            config["fused_update"] = self.fused_update
        config["name"] = self.name
        inner = keras.saving.serialize_keras_object(self.inner_optimizer)
        if self.gradient_accumulation_steps_taken:
            # Give the accumulation back to the inner optimizer's config:
            # from_config takes it over again.
            inner["config"]["gradient_accumulation_steps"] = (
                self.gradient_accumulation_steps_taken
            )
        config["inner_optimizer"] = inner
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


def _check_loss(loss, mode: str) -> None:
    dtype = getattr(loss, "dtype", None)
    if dtype is None:
        return
    dtype = tf.as_dtype(dtype)
    if not dtype.is_floating:
        raise TypeError(
            f"The loss must be a floating-point tensor to be scaled. Received a "
            f"loss of dtype {dtype.name}. Cast it first: tf.cast(loss, 'float32')."
        )
    if mode != ls.NONE and dtype.size < 4:
        raise TypeError(
            f"The loss is {dtype.name}; a scaled {dtype.name} loss overflows "
            "(float16 above 65504, so any loss scale of 2**16 or more). Expected a "
            "float32 loss, as Keras's losses compute. Compute it in float32: "
            "cast the predictions first, tf.cast(y_pred, 'float32')."
        )


def _match_saved_names(names: list[str], file_keys: list[str]) -> dict[str, str]:
    """name -> the file's key holding its value.

    The same name first. A gradient accumulator is named after its
    variable's path, which holds the enclosing model's name when the model
    built the layer (`mlp_dense_kernel_gradient_accumulator`) and not when
    `load_model` did (`dense_kernel_gradient_accumulator`): so a name left
    over matches the one file key that it ends, or that ends it, at a `_`.
    Two candidates match neither.
    """
    found = {name: name for name in names if name in set(file_keys)}
    left = [k for k in file_keys if k not in found]
    for name in names:
        if name in found:
            continue
        short = name.split(_SEPARATOR, 1)[-1]
        candidates = []
        for key in left:
            other = key.split(_SEPARATOR, 1)[-1]
            if other.endswith(f"_{short}") or short.endswith(f"_{other}"):
                candidates.append(key)
        if len(candidates) == 1:
            found[name] = candidates[0]
            left.remove(candidates[0])
    return found
