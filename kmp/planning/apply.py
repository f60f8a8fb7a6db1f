"""`kmp.prepare`: a model's precision plan applied through Keras's public
`layer.dtype_policy` setter, and completed once the model is built."""

from __future__ import annotations

import logging

import keras

from kmp._base import warn as _warn
from kmp.backend import outputs
from kmp.backend import tracing
from kmp.planning import saved
from kmp.planning.applied import Applied
from kmp.planning.applied import applied_to
from kmp.planning.decisions import Plan
from kmp.planning.decisions import changes_an_output
from kmp.planning.decisions import plan
from kmp.precision import quantization
from kmp.precision import regularization
from kmp.precision import rules
from kmp.precision import traversal

logger = logging.getLogger("kmp")


def prepare(model: keras.layers.Layer) -> keras.layers.Layer:
    """Applies kmp's precision rules to a Keras model, in place.

    Works on Sequential, Functional, subclassed and nested models, built or
    not, through Keras's public `layer.dtype_policy` setter. Idempotent: a
    second call changes nothing. `kmp.compile` calls it for you. A layer
    keeps the dtype it returns wherever user code consumes it (see
    `kmp.rules`); the model's outputs are cast to float32 where they are
    handed on (Keras's losses and metrics cast them; kmp's `predict` does).

    An attention layer that is not built yet (its projections are created
    at build time) is left as it is, with a warning: call `prepare` again
    once the model is built.

    Call it before compiling: where it changes a layer, `evaluate` and
    `predict` traced before (of the model and of the models inside it) are
    traced again at their next use, and `compile` traces `fit`'s step
    again. `predict` then returns float32 where the model computes 16-bit
    outputs (Keras's own `compile` afterwards makes its own `predict`;
    `kmp.compile` keeps the cast). Calling the model yourself returns its
    compute dtype, as in Keras.

    Args:
        model: A `keras.Model` (or any `keras.layers.Layer`).

    Returns:
        The same model, for chaining.

    Raises:
        TypeError: if `model` is not a Keras layer or model.
        RuleConflictError: if two rules of the same rank disagree about a
            layer; the model is then left unchanged.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = kmp.prepare(keras.Sequential([
    ...     keras.Input((8,)),
    ...     keras.layers.Dense(16),
    ...     keras.layers.LayerNormalization(),
    ...     keras.layers.Softmax(),
    ...     keras.layers.Dense(4),
    ... ]))
    >>> [layer.compute_dtype for layer in model.layers]
    ['float16', 'float16', 'float32', 'float16']
    >>> model.predict(np.ones((1, 8)), verbose=0).dtype  # the output, cast
    dtype('float32')

    See also: `kmp.precision_report`, `kmp.set_layer_policy`, `kmp.compile`.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "prepare() expects a Keras model or layer. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    if apply(plan(model)):  # plan raises before anything is changed
        forget_traced(model)
    outputs.install(model)
    return model


def float32_user_outputs(model: keras.layers.Layer) -> list[tuple[str, str]]:
    """The (path, policy name) of the layers kmp computes in float32 whose
    output goes to user code of `model` (its call, its train_step), each
    with the policy it would have without that rule."""
    the_plan = plan(model)
    return [
        (d.path, the_plan.base.name)
        for d in the_plan
        if changes_an_output(d) and d.site.user_code is not None
    ]


def all_built(model: keras.layers.Layer) -> bool:
    """Whether every layer of `model` is built."""
    return all(s.layer.built for s in traversal.walk(model))


def ready(model: keras.layers.Layer) -> bool:
    """Whether every layer of `model` is built and kmp can trace it: its
    plan can then read what its `call` does."""
    return tracing.traceable(model) and all_built(model)


def complete(model: keras.layers.Layer) -> int:
    """`prepare` once more, for a model built since it was compiled (its
    `call` can be traced now); returns how many layers' policies changed.
    Functions Keras traced before with the old policies (`evaluate`,
    `predict`) are traced again at their next use."""
    changed = apply(plan(model))
    if changed:
        forget_traced(model)
    return changed


def forget_traced(model: keras.layers.Layer) -> None:
    """Has Keras trace `evaluate` and `predict` again at their next use, for
    `model` and every model inside it (a backbone's own `predict` run
    before): they were traced with the old policies. (`fit`'s step is
    traced again by `kmp.compile`, or by Keras's `compile`.) `model`'s
    `predict`, and that of a model inside it compiled by kmp, casts its
    outputs to float32 (`kmp.backend.outputs`)."""
    models = [model] + [s.layer for s in traversal.walk(model)]
    for inner in models:
        if isinstance(inner, keras.Model):
            casts = isinstance(inner.predict_function, outputs.Float32Predict)
            inner.test_function = None
            inner.predict_function = None
            if casts or inner is model:
                outputs.install(inner)


def apply(the_plan: Plan) -> int:
    """Applies a plan made by `plan(model)` to its model (`prepare` is
    `apply(plan(model))`); returns how many layers' policies it changed."""
    model = the_plan.model
    changed = 0
    for d in the_plan:
        if d.explicit or d.policy is None:
            continue
        if quantization.float_part(d.layer) != d.policy.keras_name:
            quantization.set_float_part(d.layer, d.policy.keras_name)
            changed += 1
        applied_to[d.layer] = Applied(d.policy.keras_name, d.rule)
        if d.policy.is_16bit:
            regularization.compute_in_float32(d.layer)
    saved.write(model)
    for rule in the_plan.unmatched:
        _warn.warn(
            rules.unmatched_message(
                rule,
                _candidates(the_plan, rule),
                f"of {model.name!r}",
            )
        )
    if the_plan.unbuilt_attention:
        _warn.warn(
            "kmp.prepare: the attention layers "
            f"{', '.join(the_plan.unbuilt_attention)} are not built yet, so "
            "their scores rule is not applied (their projections are created "
            "at build time). Build the model first (call it on a batch, or "
            "start it from keras.Input) and call kmp.prepare again."
        )
    logger.debug("kmp.prepare(%s): %d layer policies changed", model.name, changed)
    return changed


def _candidates(the_plan: Plan, rule: rules.LayerRule) -> set[str]:
    if rule.kind == "class":
        return {type(d.layer).__name__ for d in the_plan}
    return {d.layer.name for d in the_plan} | {d.path for d in the_plan}
