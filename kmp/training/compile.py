"""`kmp.compile`: `model.compile` with kmp's precision rules applied first and
every optimizer given kmp's loss scaling (or, where nothing computes in
float16, kmp's skipping of non-finite steps)."""

from __future__ import annotations

import inspect
from typing import Any

import keras

from kmp._base import backends
from kmp._base import warn as _warn
from kmp.backend import drift
from kmp.backend import fused
from kmp.backend import grappler
from kmp.backend import ranges
from kmp.planning import applied as applied_lib
from kmp.planning import apply as plan_apply
from kmp.planning import decisions as planning
from kmp.precision import policy as policy_lib
from kmp.scaling import registry
from kmp.scaling import unscaling
from kmp.scaling.optimizer import LossScaleOptimizer
from kmp.training import attach


def compile(
    model: keras.Model,
    *args: Any,
    fused_update: bool | None = None,
    sample: Any = None,
    **kwargs: Any,
) -> keras.Model:
    """Applies kmp's precision rules to `model`, then calls `model.compile`
    with the same arguments, its optimizers wrapped in kmp's.

    Use it in place of `model.compile(...)`: it takes the arguments of the
    model's own `compile` (positional ones too, also for a model that defines
    its own `compile`, such as a GAN's `compile(d_optimizer, g_optimizer,
    loss_fn)`) and passes them on unchanged, except that every argument that
    is a Keras optimizer (or the `optimizer` argument's name, such as
    `"adam"`) becomes a `kmp.LossScaleOptimizer` around it:

    * in mode `'dynamic'` when any layer of the model computes in float16
      (read from the model's own layers, not the global policy: a model
      built in a `kmp.policy_scope`, or a float16 part of a float32 model,
      gets loss scaling);
    * in mode `'none'` otherwise (bfloat16, float32): no scaling, but a step
      whose gradients are inf/NaN is still skipped, counted and shown in
      `History`; with `auto_scale_loss=False` too.

    An optimizer that already is a loss-scale optimizer (kmp's or Keras's) is
    kept. The float32 weight update is fused by XLA where that helps.
    The precision report says what was
    decided (`kmp.precision_report(model).loss_scaling`).

    Args:
        model: The Keras model to compile.
        *args: Positional arguments of `model.compile`.
        fused_update: `None` (default) fuses the optimizer update where that
            helps: Keras's optimizer classes tested for it, updates of at
            least a million weights, machines without GPUs or TPUs, no
            gradient accumulation;
            `True` always; `False` never. For an optimizer
            that already is a `kmp.LossScaleOptimizer`, set it there instead.
        sample: A batch of inputs (real data). Where the model computes in
            16-bit, kmp runs it on the batch at its policies and with every
            layer in float32. It warns about the layers whose results move
            far beyond 16-bit rounding (cancellation, inputs with more
            digits than 16 bits hold), and, in float16, about those whose
            activations reach float16's largest value (65504): those
            overflow whatever the loss scale. Each warning names the
            layers and the fix (`kmp.debug.precision_audit(model,
            sample=...)` gives the full table). None (default): no check.
        **kwargs: Keyword arguments of `model.compile`.

    Returns:
        The same model, compiled.

    Raises:
        TypeError: if `model` is not a `keras.Model`, or the arguments do not
            fit its `compile`.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(3, activation="softmax")])
    >>> model = kmp.compile(model, "adam", "sparse_categorical_crossentropy")
    >>> model.layers[-1].compute_dtype, model.optimizer.mode
    ('float32', 'none')

    See also: `kmp.prepare`, `kmp.precision_report`.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "kmp.compile() expects a keras.Model. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    fused.check_setting(fused_update)
    if sample is not None:
        backends.require_tensorflow(
            "kmp.compile(sample=...), which checks activations in TensorFlow's "
            "traced graph,",
            "Compile without sample=.",
        )
    try:
        bound = inspect.signature(model.compile).bind_partial(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"kmp.compile(model, ...) passes its arguments to "
            f"{type(model).__name__}.compile, which does not take them: {e}."
        ) from e
    arguments = _flat_arguments(bound)
    standard = type(model).compile is keras.Model.compile
    for name, parameter in bound.signature.parameters.items():
        # An optimizer the caller left at its default is wrapped too
        # (Keras's "rmsprop", KerasHub's "auto").
        if (
            "optimizer" in name
            and name not in arguments
            and parameter.default is not inspect.Parameter.empty
            and parameter.default is not None
        ):
            arguments[name] = parameter.default
    candidates = {
        name: value for name, value in arguments.items() if _is_optimizer(name, value)
    }
    # Optimizers passed through a compile(self, *args) are wrapped in place.
    positional = {}
    for name, value in list(arguments.items()):
        parameter = bound.signature.parameters.get(name)
        if parameter is not None and parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            for i, item in enumerate(value):
                if isinstance(item, keras.optimizers.Optimizer):
                    positional[f"{name}_{i}"] = (name, i)
                    candidates[f"{name}_{i}"] = item
    kept = {
        n: v
        for n, v in candidates.items()
        if isinstance(v, keras.optimizers.LossScaleOptimizer)
    }
    if kept and fused_update is not None:
        raise ValueError(
            "kmp.compile(fused_update=...) applies when kmp wraps the "
            f"optimizer, but {', '.join(kept)} already is a loss-scale "
            "optimizer. Set it there instead: "
            "kmp.LossScaleOptimizer(inner, fused_update=...)."
        )
    _refuse_tf_keras_2_contract_in_keras_train_step(model, kept)
    built = model.built
    lost = policy_lib.lost_policy(applied_lib.base_policy(model).keras_name)
    if lost:
        _warn.warn(lost)
    the_plan = planning.plan(model)
    if plan_apply.apply(the_plan):
        # The models inside traced evaluate and predict with the old policies
        # (this model's own are made again by its compile).
        plan_apply.forget_traced(model)
    float16 = the_plan.computes_in_float16
    # The fast-path settings follow the model being compiled (grappler reads
    # them when `fit` first runs), also when it was built in a policy_scope.
    grappler.apply_fast_paths("float16" if float16 else the_plan.base.compute_dtype)
    if sample is not None and float16:
        _warn_overflowing(model, sample)
    if sample is not None and the_plan.computes_in_16bit:
        _warn_imprecise(model, sample)
    scale = float16 and arguments.get("auto_scale_loss", True) is not False
    wrapped: dict[str, Any] = {}
    unresolved: dict[str, str] = {}
    for name, value in candidates.items():
        if name in kept:
            wrapped[name] = value
            continue
        optimizer = _resolve(value)
        if optimizer is None:
            unresolved[name] = value  # the model's own compile resolves it
            continue
        wrapped[name] = _wrap(optimizer, scale, fused_update)
        if name in positional:
            holder, i = positional[name]
            items = list(arguments[holder])
            items[i] = wrapped[name]
            arguments[holder] = tuple(items)
        else:
            arguments[name] = wrapped[name]
    _call(model, bound, arguments)
    if unresolved and standard is False:
        # A name only the model's compile knows (KerasHub's "auto"): take
        # what it made, wrap it, and compile again with the object.
        resolved = getattr(model, "optimizer", None)
        if isinstance(resolved, keras.optimizers.LossScaleOptimizer) and not (
            isinstance(resolved, LossScaleOptimizer)
        ):
            resolved = resolved.inner_optimizer  # Keras's wrapper: replaced
        if isinstance(resolved, keras.optimizers.Optimizer) and not isinstance(
            resolved, LossScaleOptimizer
        ):
            name = next(iter(unresolved))
            wrapped[name] = arguments[name] = _wrap(resolved, scale, fused_update)
            _call(model, bound, arguments)
    if wrapped:
        registry.register(model, wrapped)
    # Its train function completes the plan once fit has built the model,
    # and adds the telemetry to a train_step's own logs.
    attach.attach(model, complete_plan=not built and planning.runs_own_call(model))
    return model


def _warn_overflowing(model: keras.Model, sample: Any) -> None:
    """Warns about the layers whose activations on `sample`, computed in
    float32, reach float16's largest value."""
    measured = ranges.activation_ranges(model, sample)
    if measured.error:
        raise ValueError(
            f"kmp.compile(sample=...) runs {model.name!r} on the sample to "
            f"check its activations' range, and it could not: {measured.error}. "
            "Expected a batch the model takes as input, as fit() receives it "
            "(without the targets)."
        )
    over = measured.above(policy_lib.FLOAT16_MAX)
    if over:
        named = ", ".join(f"{r.path!r} ({r.max_abs:.3g})" for r in over)
        first = over[0].path
        _warn.warn(
            f"kmp: on the sample, these layers of {model.name!r} compute "
            f"activations beyond float16's largest value "
            f"({policy_lib.FLOAT16_MAX:g}): {named}. In float16 they overflow "
            "to inf whatever the loss scale, and the steps that do are "
            "skipped. Compute them in float32 (kmp.set_layer_policy("
            f"'name:{first}', 'float32'), then compile again), or train in "
            "bfloat16 ('mixed_bfloat16', float32's range) where its precision "
            "suffices: kmp.debug.precision_audit(model, sample=...) lists "
            "them and checks which."
        )


def _described(sample: Any) -> str:
    """A sample's structure, each array as its type and shape."""
    return str(
        keras.tree.map_structure(
            lambda x: f"{type(x).__name__}{tuple(getattr(x, 'shape', ()))}", sample
        )
    )


def _warn_imprecise(model: keras.Model, sample: Any) -> None:
    """Warns about the layers whose results on `sample` move from float32's
    by far more than 16-bit rounding explains."""
    measured = drift.layer_drift(model, sample)
    if measured.error:
        raise ValueError(
            f"kmp.compile(sample=...) runs {model.name!r} on the sample to "
            f"compare it with float32, and it could not: {measured.error}. "
            "Expected a batch the model takes as input, as fit() receives it "
            f"(without the targets). Received: {_described(sample)}."
        )
    lost = measured.beyond_rounding()
    if lost:
        named = ", ".join(f"{d.path!r} ({d.error:.0%})" for d in lost)
        paths = dict.fromkeys(p for d in lost for p in d.fix_paths)
        rules = "; ".join(f"kmp.set_layer_policy('name:{p}', 'float32')" for p in paths)
        _warn.warn(
            f"kmp: on the sample, the results of these layers of {model.name!r} "
            f"differ from float32's by far more than {measured.dtype} rounding "
            f"explains: {named}. They cancel, or their inputs carry more "
            "digits than 16 bits hold, and training reaches a worse loss "
            f"without any NaN. Compute them in float32: {rules}; then "
            "compile again. kmp.debug.precision_audit(model, sample=...) "
            "lists them with the cause."
        )


def _refuse_tf_keras_2_contract_in_keras_train_step(model, optimizers: dict) -> None:
    """Keras's own `train_step` hands `apply_gradients` the gradients of
    `scale_loss(loss)`, which an optimizer with tf.keras 2's contract does
    not take: refused here, before anything trains."""
    own_step = type(model).train_step is keras.Model.train_step
    for name, opt in optimizers.items():
        if own_step and getattr(opt, "_contract", None) == unscaling.UNSCALED:
            raise ValueError(
                f"{name} is a kmp.mixed_precision.LossScaleOptimizer, whose "
                "apply_gradients takes unscaled gradients (tf.keras 2's "
                "contract), but this model trains with Keras's own train_step, "
                "which hands it the gradients of scale_loss(loss). Pass the "
                f"inner optimizer instead: kmp.compile(model, {name}="
                f"{name}.inner_optimizer), or a kmp.LossScaleOptimizer."
            )


def _flat_arguments(bound: inspect.BoundArguments) -> dict[str, Any]:
    """The bound arguments by name, a `**kwargs` catch-all flattened in."""
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        parameter = bound.signature.parameters[name]
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            arguments[name] = value
        else:
            arguments[name] = value
    return arguments


def _call(model: keras.Model, bound: inspect.BoundArguments, arguments: dict) -> None:
    """Calls `model.compile` with `arguments`, positional ones in place: the
    parameters before a filled `*args` go positionally, in order."""
    parameters = bound.signature.parameters
    extra = [
        value
        for name, value in arguments.items()
        if name in parameters
        and parameters[name].kind is inspect.Parameter.VAR_POSITIONAL
    ]
    extra = list(extra[0]) if extra else []
    args, kwargs = [], {}
    for name, value in arguments.items():
        kind = parameters[name].kind if name in parameters else None
        if kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if kind is inspect.Parameter.POSITIONAL_ONLY or (
            extra and kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ):
            args.append((list(parameters).index(name), value))
        else:
            kwargs[name] = value
    args = [value for _, value in sorted(args, key=lambda item: item[0])]
    model.compile(*args, *extra, **kwargs)


def _is_optimizer(name: str, value: Any) -> bool:
    if isinstance(value, keras.optimizers.Optimizer):
        return True
    return "optimizer" in name and isinstance(value, (str, dict))


def _resolve(value: Any) -> keras.optimizers.Optimizer | None:
    """An optimizer object for a name or config, as Keras would resolve it,
    or None for a name Keras does not know."""
    if isinstance(value, keras.optimizers.Optimizer):
        return value
    try:
        return keras.optimizers.get(value)
    except ValueError:
        return None


def _wrap(optimizer: Any, scale: bool, fused_update: bool | None) -> LossScaleOptimizer:
    """The kmp optimizer that takes `optimizer`'s place."""
    return LossScaleOptimizer(
        optimizer, mode="dynamic" if scale else "none", fused_update=fused_update
    )


def describe_loss_scaling(model: keras.Model) -> str:
    """In words: how `model`'s optimizers scale the loss (for reports)."""
    optimizers = registry.optimizers_of(model)
    if not optimizers:
        return "not compiled"
    float16 = planning.plan(model).computes_in_float16
    why = "layers compute in float16" if float16 else "no layer computes in float16"
    parts = []
    for label, opt in optimizers.items():
        if isinstance(opt, LossScaleOptimizer):
            text = (
                f"{opt.mode} (kmp.LossScaleOptimizer; non-finite steps skipped)"
                if opt.mode != "none"
                else "none (kmp.LossScaleOptimizer; non-finite steps skipped)"
            )
        elif isinstance(opt, keras.optimizers.LossScaleOptimizer):
            text = "dynamic (Keras's LossScaleOptimizer)"
        else:
            text = f"none ({type(opt).__name__}: non-finite steps are applied)"
        parts.append(text if len(optimizers) == 1 else f"{label}: {text}")
    unscaled = [
        o
        for o in optimizers.values()
        if isinstance(o, LossScaleOptimizer) and o.mode == "none"
    ]
    if float16 and unscaled:
        why += (
            ", but loss scaling is off (auto_scale_loss=False or mode='none'): "
            "small float16 gradients may underflow to zero"
        )
    return f"{'; '.join(parts)}: {why}"
