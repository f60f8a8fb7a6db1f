"""`kmp.LossScaleOptimizer`: dynamic (or static) loss scaling around any Keras
optimizer, inside `model.fit` and in custom loops.

It subclasses `keras.optimizers.LossScaleOptimizer` so that Keras's `compile`
recognises it and never wraps it a second time; the scaling itself is kmp's
(`kmp.loss_scale.next_state`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import keras
import tensorflow as tf

from kmp import fused
from kmp import loss_scale as ls
from kmp import policy as policy_lib

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
_PUBLIC_NAME = {
    "scale": "loss_scale",
    "good_steps": "good_steps",
    "hysteresis_left": "hysteresis_left",
    "skipped_total": "skipped_steps_total",
    "consecutive_skips": "consecutive_skips",
    "last_finite": "last_step_finite",
}
# The optimizer's loss-scale state, by public name.
STATE_NAMES = tuple(_PUBLIC_NAME.values())
_DEFAULT = ls.LossScaleConfig()


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Scales the loss so that small float16 gradients survive, and skips the
    steps whose gradients overflow.

    Each step: the loss is multiplied by the scale, the gradients are divided
    by it (in float32) and checked for inf/NaN, one flag per tensor reduced
    to one decision, in the same pass; only finite steps reach
    the inner optimizer (a skipped step changes no weight, no slot and not
    `iterations`); then the scale moves as `kmp.LossScaleConfig` describes.
    Clipping set on the inner optimizer acts on the unscaled gradients.

    With `gradient_accumulation_steps=N` on the inner optimizer, an overflow
    anywhere in a window of N micro-batches skips the whole window, and the
    scale's growth interval counts optimizer steps, not micro-batches.

    Under a policy that needs no loss scaling (bfloat16, float32) the
    wrapper is a pass-through (mode `'none'`), so scripts need no branches.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap (an
            instance or a name such as `"adam"`).
        initial_scale, growth_factor, backoff_factor, growth_interval,
        min_scale, max_scale, hysteresis: See `kmp.LossScaleConfig`.
        mode: `'dynamic'`, `'static'` (fixed scale) or `'none'`. By default
            `'dynamic'` when the global policy computes in float16 and
            `'none'` otherwise.
        fused_update: Whether the inner optimizer's update runs as one XLA
            program (`kmp.fused`): the same formulas, with the elementwise
            passes over the float32 weights fused. `None` (default) fuses
            the Keras optimizer classes in `kmp.fused.TESTED` on machines
            without GPUs or TPUs, outside tf.distribute strategies; `True`
            or `False` force it (`True` also fuses other classes, such as
            your own).
        name: The optimizer's name.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
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
                "backoff_factor, growth_interval, min_scale, max_scale, "
                "hysteresis, mode, fused_update and name; optimizer settings "
                "belong on the inner optimizer."
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
        if mode is None:
            mode = ls.DYNAMIC if policy_lib.get_policy().needs_loss_scaling else ls.NONE
        config = ls.LossScaleConfig(
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            mode=mode,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=config.initial_scale,
            dynamic_growth_steps=config.growth_interval,
            name=name,
        )
        self.config = config
        self.fused_update = fused.check_setting(fused_update)
        # Not tracked: it holds tf.functions, not state.
        object.__setattr__(self, "_fused_apply", fused.FusedApply(inner_optimizer))
        # Gradient accumulation with loss scaling: an overflow anywhere in a
        # window must skip the whole window, which the inner optimizer's own
        # accumulation cannot do (it has no way to discard a window). kmp
        # takes it over: it accumulates unscaled micro-batch gradients and
        # hands the inner optimizer one mean gradient per window.
        self.gradient_accumulation_steps_taken = None
        if config.mode != ls.NONE and inner_optimizer.gradient_accumulation_steps:
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
        # The loss-scale state, plus whether the last loss was finite. Created
        # here, like Keras's own `iterations`, so that telemetry can read it
        # (and the trainer's first trace can write it) before `build`.
        values = ls.LossScaleState.initial_values(config)
        for (field, dtype), value in zip(ls.LossScaleState.SPEC, values, strict=True):
            self._add_scalar(_PUBLIC_NAME[field], dtype.name, value)
        self._add_scalar("last_loss_finite", "bool", True)
        # Whether the loss was finite at the last *skipped* step.
        self._add_scalar("overflow_loss_finite", "bool", True)
        # Whether the gradients the next apply() receives are already
        # unscaled: set by the APIs that hand out unscaled gradients
        # (ScaledGradientTape.gradient, get_unscaled_gradients), cleared by
        # scale_loss and by apply. A variable, not Python state, so that it
        # holds when gradients and apply live in different tf.functions.
        self._add_scalar("grads_unscaled", "bool", False)

    def __repr__(self) -> str:
        inner = type(self.inner_optimizer).__name__
        if self.config.mode == ls.NONE:
            return f"<kmp.LossScaleOptimizer mode=none (pass-through) inner={inner}>"
        return (
            f"<kmp.LossScaleOptimizer mode={self.config.mode} "
            f"initial_scale={self.config.initial_scale} inner={inner}>"
        )

    @property
    def mode(self) -> str:
        """`'dynamic'`, `'static'` or `'none'` (pass-through)."""
        return self.config.mode

    # --- state ----------------------------------------------------------

    def _add_scalar(self, name: str, dtype: str, value: Any) -> None:
        variable = self.add_variable(
            shape=(),
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            # Every replica computes the same value (decisions are agreed on
            # across replicas first), so the first replica's write stands.
            aggregation="only_first_replica",
            name=name,
        )
        # Bypass Keras's attribute tracking: add_variable already tracked it.
        object.__setattr__(self, f"_{name}", variable)

    def build(self, var_list):
        # An explicit fused_update=True under a strategy fails here, before
        # any collective is traced (apply checks again for custom loops).
        fused.resolve(self.fused_update)
        # Per-variable finiteness of the last skipped step's gradients, in
        # `var_list` order: which variables overflowed (kmp.debug reads it).
        self._overflow_flags = self.add_variable(
            shape=(len(var_list),),
            dtype="bool",
            initializer=keras.initializers.Constant(True),
            aggregation="only_first_replica",
            name="overflow_flags",
        )
        self._variable_index = {id(v): i for i, v in enumerate(var_list)}
        # Plain attribute (not tracked: these are the model's variables).
        object.__setattr__(self, "_flag_variables", tuple(var_list))
        if self.gradient_accumulation_steps_taken:
            strategy = tf.distribute.get_strategy()
            if strategy.num_replicas_in_sync > 1:
                raise NotImplementedError(
                    "Gradient accumulation with loss scaling is not supported "
                    f"under {type(strategy).__name__} yet (kmp would have to "
                    "agree on whole windows across replicas). Use a larger "
                    "global batch instead of gradient_accumulation_steps, or "
                    "train on one device."
                )
            self._micro_step = self.add_variable(
                shape=(),
                dtype="int64",
                initializer="zeros",
                aggregation="none",
                name="micro_step",
            )
            self._window_finite = self.add_variable(
                shape=(),
                dtype="bool",
                initializer=keras.initializers.Constant(True),
                aggregation="none",
                name="window_finite",
            )
            self._accumulators = [
                self.add_variable_from_reference(v, name="gradient_accumulator")
                for v in var_list
            ]
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)
        if self.mode == ls.NONE and policy_lib.get_policy().needs_loss_scaling:
            logger.warning(
                "kmp.LossScaleOptimizer was created under a policy without loss "
                "scaling but is used under %s: float16 gradients may underflow. "
                "Create it after kmp.set_policy(...), or pass mode='dynamic'.",
                policy_lib.get_policy().name,
            )

    def _state(self) -> ls.LossScaleState:
        return ls.LossScaleState(
            *(getattr(self, f"_{_PUBLIC_NAME[f]}") for f, _ in ls.LossScaleState.SPEC)
        )

    @property
    def loss_scale(self) -> keras.Variable:
        """The current loss scale (a float32 variable; 1.0 in mode `'none'`)."""
        return self._loss_scale

    @property
    def dynamic_scale(self) -> keras.Variable:
        """Alias of `loss_scale`, the name Keras's own wrapper uses."""
        return self.loss_scale

    @property
    def skipped_steps_total(self) -> keras.Variable:
        """Steps skipped because of non-finite gradients, in total."""
        return self._skipped_steps_total

    @property
    def consecutive_skips(self) -> keras.Variable:
        """Steps skipped in a row, up to and including the last one."""
        return self._consecutive_skips

    @property
    def good_steps(self) -> keras.Variable:
        """Finite steps since the scale last changed."""
        return self._good_steps

    @property
    def hysteresis_left(self) -> keras.Variable:
        """Overflows still tolerated before the next backoff."""
        return self._hysteresis_left

    @property
    def last_step_finite(self) -> keras.Variable:
        """Whether the last step's gradients were finite (it was applied)."""
        return self._last_step_finite

    @property
    def last_loss_finite(self) -> keras.Variable:
        """Whether the last loss (before scaling) was finite. False means the
        forward pass itself overflowed, not the gradients."""
        return self._last_loss_finite

    @property
    def overflow_loss_finite(self) -> keras.Variable:
        """Whether the loss was finite at the last skipped step (False: that
        step's overflow was in the forward pass)."""
        return self._overflow_loss_finite

    @property
    def overflow_flags(self) -> keras.Variable:
        """Per trainable variable (in build order): False where the last
        skipped step's gradient held inf/NaN. See `kmp.debug.last_overflow`."""
        if not self.built:
            raise ValueError(
                "overflow_flags is not available yet: it is created when the "
                "optimizer is built, which it is not. Train a step first, or call "
                "optimizer.build(model.trainable_variables)."
            )
        return self._overflow_flags

    def _current_scale(self):
        if self.mode == ls.NONE:
            return None
        return self._loss_scale

    def in_training_step(self) -> bool:
        """Whether the graph being built (or eager code) is one in which this
        optimizer scaled a loss: a training step."""
        ref = getattr(self, "_train_graph", None)
        return ref is not None and ref() is tf.compat.v1.get_default_graph()

    def _record_loss(self, loss) -> None:
        self._last_loss_finite.assign(_agree(tf.reduce_all(tf.math.is_finite(loss))))

    # --- scaling ----------------------------------------------------------

    def scale_loss(self, loss):
        """Returns `loss * scale` (Keras's trainer calls this inside `fit`)."""
        _check_loss(loss, self.mode)
        self._record_loss(loss)
        self._grads_unscaled.assign(False)
        # Which graph is a training step: kmp.telemetry reports only there
        # (not in evaluate). Trace-time bookkeeping, read at trace time.
        object.__setattr__(
            self, "_train_graph", weakref.ref(tf.compat.v1.get_default_graph())
        )
        scale = self._current_scale()
        if scale is None:
            return loss
        return loss * tf.cast(scale, loss.dtype)

    def get_scaled_loss(self, loss):
        """tf.keras 2 spelling: returns `loss * scale`.

        Pair it with `get_unscaled_gradients` and `apply_gradients`, as in
        TensorFlow's mixed-precision guide.
        """
        return self.scale_loss(loss)

    def _unscale(self, grads, variables=None, factor=None):
        """Multiplies gradients by `factor` (default 1/scale), in float32.

        Gradients of variables Keras overwrites with their "gradient"
        (float8 scales and histories) are left alone, as Keras's wrapper does.
        """
        if self._current_scale() is None:
            return list(grads)
        if factor is None:
            factor = 1.0 / tf.convert_to_tensor(self._loss_scale)
        if variables is None:
            variables = [None] * len(grads)

        def times(values):
            return tf.cast(tf.cast(values, tf.float32) * factor, values.dtype)

        out = []
        for g, v in zip(grads, variables, strict=True):
            if g is None or getattr(v, "overwrite_with_gradient", False):
                out.append(g)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(times(g.values), g.indices, g.dense_shape))
            else:
                out.append(times(g))
        return out

    def get_unscaled_gradients(self, grads):
        """tf.keras 2 spelling: returns `grads / scale`; pass the result to
        `apply_gradients` or `apply`, which will not unscale them again."""
        grads = self._unscale(list(grads))
        if self._current_scale() is not None:
            self._grads_unscaled.assign(True)
        return grads

    # --- applying ----------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Unscales `grads` (unless they came unscaled from a
        `ScaledGradientTape` or `get_unscaled_gradients`), applies them with
        the inner optimizer only if all are finite, and updates the scale.

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
        if self.mode == ls.NONE:
            self._apply_inner(grads, trainable_variables)
            return tf.constant(True)
        variables = (
            self._trainable_variables
            if trainable_variables is None
            else list(trainable_variables)
        )
        factor = tf.where(
            tf.convert_to_tensor(self._grads_unscaled),
            tf.constant(1.0),
            1.0 / tf.convert_to_tensor(self._loss_scale),
        )
        grads = self._unscale(grads, variables, factor)
        self._grads_unscaled.assign(False)
        # One flag per gradient, agreed on across replicas: a non-finite value
        # on any replica makes every replica skip the step.
        flags = _agree(ls.finite_flags(grads))
        finite = tf.reduce_all(flags)
        by_variable = self._flags_by_variable(flags, variables)
        if self.gradient_accumulation_steps_taken:
            self._record_overflow(by_variable, finite)
            return self._accumulate(grads, trainable_variables, finite)
        return self._step(grads, variables, finite, by_variable)

    def _flags_by_variable(self, flags, variables):
        """Places per-gradient flags at their variables' build positions."""
        n = self._overflow_flags.shape[0]
        unknown = [v for v in variables if id(v) not in self._variable_index]
        if unknown:
            raise ValueError(
                f"apply() received variables the optimizer was not built with: "
                f"{', '.join(getattr(v, 'path', str(v)) for v in unknown)}. "
                "Expected a subset of the variables passed to build() (or to the "
                "first apply()). Use one optimizer per set of variables."
            )
        positions = [self._variable_index[id(v)] for v in variables]
        if positions == list(range(n)):
            return flags
        return tf.tensor_scatter_nd_update(
            tf.ones((n,), tf.bool), [[p] for p in positions], flags
        )

    def _record_overflow(self, by_variable, finite) -> None:
        """Keeps the per-variable flags of the latest non-finite step."""
        self._overflow_flags.assign(
            tf.where(finite, tf.convert_to_tensor(self._overflow_flags), by_variable)
        )
        self._overflow_loss_finite.assign(
            tf.where(
                finite,
                tf.convert_to_tensor(self._overflow_loss_finite),
                tf.convert_to_tensor(self._last_loss_finite),
            )
        )

    def _update_state(self, finite, by_variable=None) -> None:
        """The one place the loss-scale state moves (`next_state`)."""
        if by_variable is not None:
            self._record_overflow(by_variable, finite)
        new = ls.next_state(self.config, self._state(), finite)
        for variable, value in zip(self._state().fields(), new.fields(), strict=True):
            variable.assign(value)

    def _step(self, grads, variables, finite, by_variable=None):
        """One optimizer step: apply if finite, then move the scale.

        Under a tf.distribute strategy that needs merge calls (Mirrored),
        the inner optimizer's apply (which all-reduces the gradients) cannot
        sit inside a condition in replica context; as Keras's own wrapper
        does, the condition and the state update then run once, in
        cross-replica context, and each replica applies inside it.
        """
        context = tf.distribute.get_replica_context()
        needs_merge = (
            context is not None
            and tf.distribute.has_strategy()
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()
        )
        if not needs_merge:

            def apply_inner():
                self._apply_inner(grads, variables)
                return tf.constant(True)

            tf.cond(finite, apply_inner, lambda: tf.constant(False))
            self._update_state(finite, by_variable)
            return finite

        def cross_replica(distribution, grads, variables, finite, by_variable):
            # Every replica agreed on `finite`: take the first replica's.
            finite = distribution.experimental_local_results(finite)[0]
            if by_variable is not None:
                by_variable = distribution.experimental_local_results(by_variable)[0]

            def apply_inner():
                distribution.extended.call_for_each_replica(
                    self.inner_optimizer.apply, args=(grads, variables)
                )
                return tf.constant(True)

            tf.cond(finite, apply_inner, lambda: tf.constant(False))
            self._update_state(finite, by_variable)
            return finite

        return context.merge_call(
            cross_replica, args=(grads, variables, finite, by_variable)
        )

    def _apply_inner(self, grads, variables) -> None:
        """The inner optimizer's update, fused by XLA where that is on."""
        if fused.resolve(self.fused_update, self.inner_optimizer):
            self._fused_apply(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)

    def _accumulate(self, grads, trainable_variables, finite):
        """One micro-batch of a gradient-accumulation window.

        Finite micro-batch gradients (unscaled) are summed; at the window's
        last micro-batch the mean is applied only if every micro-batch of the
        window was finite, and the scale moves once: the growth interval and
        the skip counters count optimizer steps (windows), not micro-batches.
        """
        steps = self.gradient_accumulation_steps_taken
        variables = (
            self._trainable_variables
            if trainable_variables is None
            else list(trainable_variables)
        )
        accumulators = [
            self._accumulators[self._variable_index[id(v)]] for v in variables
        ]
        for accumulator, g in zip(accumulators, grads, strict=True):
            if g is not None:
                g = tf.convert_to_tensor(g)
                accumulator.assign_add(tf.where(finite, g, tf.zeros_like(g)))
        window_finite = tf.logical_and(
            tf.convert_to_tensor(self._window_finite), finite
        )
        micro_step = self._micro_step + 1
        self._micro_step.assign(micro_step)

        def close_window():
            mean = [
                None if g is None else a / steps
                for a, g in zip(accumulators, grads, strict=True)
            ]
            applied = self._step(mean, variables, window_finite)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
            self._window_finite.assign(True)
            return applied

        def continue_window():
            self._window_finite.assign(window_finite)
            return tf.constant(False)

        return tf.cond(micro_step % steps == 0, close_window, continue_window)

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        return self.apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "kmp runs on the TensorFlow backend, which applies gradients "
            "statefully; stateless_apply is for JAX."
        )

    # --- serialization ------------------------------------------------------

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


def scaling_of_model(model: Any) -> LossScaleOptimizer | None:
    """The model's `kmp.LossScaleOptimizer` if it scales the loss (not a
    pass-through in mode `'none'`), else None."""
    opt = of_model(model)
    return None if opt is None or opt.mode == ls.NONE else opt


def _agree(flags):
    """ANDs boolean flags across the replicas of a tf.distribute strategy (an
    all-reduce SUM of the non-finite counts), so that every replica makes the
    same decision. Outside a multi-replica context it returns them unchanged."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return flags
    bad = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(flags), tf.float32)
    )
    return tf.equal(bad, 0.0)


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
