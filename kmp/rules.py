"""Precision rules: which layers of a model compute in which dtype, and why.

Under a 16-bit policy most layers should compute in float16/bfloat16, but a
few are numerically sensitive and must stay in float32. kmp decides every
layer's policy by the rules below and applies the decision through Keras's
public `layer.dtype_policy` setter (it takes effect at the layer's next call).

Resolution order, for each layer (first match wins):

1. An explicit `dtype=` given to the layer's constructor (detected as a policy
   that differs from the model's and was not set by kmp).
2. A layer-name rule: `kmp.set_layer_policy("name:<glob>", policy)`, matched
   against the layer's name and its path inside the model (`"block/attn"`).
3. A class rule: `kmp.set_layer_policy(LayerClass, policy)` (the class and
   its subclasses) or `kmp.set_layer_policy("class:<glob>", policy)` (matched
   against the layer's class name).
4. kmp's defaults, which apply only where the policy in force computes in a
   16-bit dtype: float32 for `Softmax`, softmax/log-softmax activations, every
   normalization layer, the attention scores of `MultiHeadAttention` and
   `GroupQueryAttention` (see below), `Attention`/`AdditiveAttention`, and
   a model output layer whose activation is softmax, log-softmax or sigmoid.
   One speed rule: under float16 on a machine with no GPU or TPU,
   convolutions compute in float32 (TensorFlow's float16 CPU convolutions
   ran 5x slower than float32 here).
5. The policy of the enclosing layer: the model's own policy at the top, and a
   container layer's decided policy for the layers inside it (so
   `kmp.set_layer_policy(MyBlock, "float32")` puts the whole block in float32).

Two rules of the same rank that match one layer and disagree raise
`RuleConflictError`; `prepare` then changes nothing.

Attention: Keras's fused attention path multiplies query by key in the
compute dtype *before* scaling them, so float16 logits overflow (inf, then
NaN) long before the float32 softmax that follows. kmp therefore computes the
query and key projections, the scores and the softmax in float32 and keeps
the value and output projections (and dropout) in the 16-bit dtype.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import keras

from kmp import policy as policy_lib
from kmp._table import format_table

logger = logging.getLogger("kmp")

FLOAT32 = "float32"
_ATTENTION_SCORES = "default: attention scores in float32"


class RuleConflictError(ValueError):
    """Two precision rules of the same rank disagree about one layer."""


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """A user rule set by `kmp.set_layer_policy`.

    Attributes:
        kind: `'name'` (a layer-name pattern) or `'class'` (a layer class or a
            class-name pattern).
        selector: The pattern string, or the layer class.
        policy: The policy the matched layers compute in.
    """

    kind: str
    selector: str | type
    policy: policy_lib.Policy

    def describe(self) -> str:
        if isinstance(self.selector, type):
            return f"rule {self.selector.__name__}"
        return f"rule {self.kind}:{self.selector}"

    def matches(self, layer: keras.layers.Layer, path: str) -> bool:
        if isinstance(self.selector, type):
            return isinstance(layer, self.selector)
        if self.kind == "class":
            return fnmatch.fnmatchcase(type(layer).__name__, self.selector)
        return fnmatch.fnmatchcase(layer.name, self.selector) or (
            fnmatch.fnmatchcase(path, self.selector)
        )


_rules: dict[tuple[str, Any], LayerRule] = {}
_rules_lock = threading.Lock()


def _parse_selector(selector: Any) -> tuple[str, str | type]:
    if isinstance(selector, type):
        if not issubclass(selector, keras.layers.Layer):
            raise TypeError(
                f"A class selector must be a subclass of keras.layers.Layer. "
                f"Received: {selector.__name__}. Pass a layer class, or match "
                "class names with 'class:<glob>'."
            )
        return "class", selector
    if isinstance(selector, str):
        kind, sep, pattern = selector.partition(":")
        if sep and kind in ("name", "class") and pattern:
            return kind, pattern
        raise ValueError(
            f"Invalid selector {selector!r}. A string selector says what it "
            "matches: 'name:<glob>' for layer names or paths (e.g. "
            "'name:head_*'), or 'class:<glob>' for class names (e.g. "
            "'class:Conv*'). Or pass the layer class itself."
        )
    raise TypeError(
        "A selector is a keras.layers.Layer subclass, 'name:<glob>' or "
        f"'class:<glob>'. Received: {selector!r} (of type "
        f"{type(selector).__name__})."
    )


def set_layer_policy(
    selector: type | str, policy: str | policy_lib.Policy | None
) -> LayerRule | None:
    """Sets the policy of every layer a selector matches, for `kmp.prepare`.

    Setting a rule for a selector that already has one replaces it; a policy
    of `None` removes it. See the module docstring of `kmp.rules` for the
    resolution order.

    Args:
        selector: A `keras.layers.Layer` subclass (matches it and its
            subclasses), `'class:<glob>'` (matches class names, e.g.
            `'class:*Conv*'`) or `'name:<glob>'` (matches layer names and
            paths, e.g. `'name:head'` or `'name:encoder/*'`).
        policy: A policy name, a `kmp.Policy`, or `None` to remove the rule.

    Returns:
        The rule, or `None` when it was removed.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> kmp.set_layer_policy("name:head", "float32")
    LayerRule(kind='name', selector='head', policy=<Policy "float32": ...>)
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
    ...                           keras.layers.Dense(4, name="head")])
    >>> [layer.compute_dtype for layer in kmp.prepare(model).layers]
    ['float16', 'float32']

    See also: `kmp.prepare`, `kmp.precision_report`.
    """
    kind, parsed = _parse_selector(selector)
    key = (kind, parsed)
    with _rules_lock:
        if policy is None:
            _rules.pop(key, None)
            return None
        rule = LayerRule(kind, parsed, policy_lib.get(policy))
        previous = _rules.get(key)
        if previous is not None and previous != rule:
            logger.info("kmp: %s replaces %s", rule, previous)
        _rules[key] = rule
    return rule


def layer_rules() -> list[LayerRule]:
    """Returns the user rules set with `kmp.set_layer_policy`.

    Example:

    >>> kmp.set_layer_policy(keras.layers.Conv2D, "float32")
    LayerRule(kind='class', selector=<class '...Conv2D'>, policy=...)
    >>> [rule.describe() for rule in kmp.layer_rules()]
    ['rule Conv2D']
    """
    with _rules_lock:
        return list(_rules.values())


def clear_layer_policies() -> None:
    """Removes every rule set with `kmp.set_layer_policy`.

    Example:

    >>> kmp.set_layer_policy("name:head", "float32")
    LayerRule(...)
    >>> kmp.clear_layer_policies()
    >>> kmp.layer_rules()
    []
    """
    with _rules_lock:
        _rules.clear()


# --- kmp's default rules --------------------------------------------------


def _activation_name(layer: keras.layers.Layer) -> str | None:
    fn = getattr(layer, "activation", None)
    if fn is None:
        return None
    for name in ("softmax", "log_softmax", "sigmoid"):
        if fn is getattr(keras.activations, name):
            return name
    name = getattr(fn, "__name__", None)
    return name if name in ("softmax", "log_softmax", "sigmoid") else None


def _normalization_classes() -> tuple[type, ...]:
    names = (
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "RMSNormalization",
        "UnitNormalization",
    )
    return tuple(getattr(keras.layers, n) for n in names if hasattr(keras.layers, n))


def _attention_classes() -> tuple[type, ...]:
    return (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)


def _convolution_classes() -> tuple[type, ...]:
    names = (
        "Conv1D",
        "Conv2D",
        "Conv3D",
        "Conv1DTranspose",
        "Conv2DTranspose",
        "Conv3DTranspose",
        "DepthwiseConv1D",
        "DepthwiseConv2D",
        "SeparableConv1D",
        "SeparableConv2D",
    )
    return tuple(getattr(keras.layers, n) for n in names if hasattr(keras.layers, n))


_SLOW_CPU_CONVOLUTION = "default: float16 convolutions are slow on CPUs"


def _float16_convolutions_are_slow() -> bool:
    """True on machines that train on the CPU: float16 convolutions were
    measured slow there both with native float16 math (issue #5's Intel
    machines, AVX512-FP16) and without it (this project's AMD, 0.20x)."""
    from kmp import hardware

    caps = hardware.capabilities()
    return not caps.gpus and not caps.tpus


def _default_rule(
    layer: keras.layers.Layer, is_output: bool, compute_dtype: str = "float16"
) -> str | None:
    """Names the default rule that puts `layer` in float32, or None."""
    if (
        compute_dtype == "float16"
        and isinstance(layer, _convolution_classes())
        and _float16_convolutions_are_slow()
    ):
        return _SLOW_CPU_CONVOLUTION
    if isinstance(layer, keras.layers.Softmax):
        return "default: softmax in float32"
    if isinstance(layer, _normalization_classes()):
        return "default: normalization in float32"
    if isinstance(layer, _attention_classes()):
        return _ATTENTION_SCORES
    if isinstance(layer, (keras.layers.Attention, keras.layers.AdditiveAttention)):
        return "default: attention softmax in float32"
    activation = _activation_name(layer)
    if activation in ("softmax", "log_softmax"):
        return f"default: {activation} in float32"
    if is_output and activation == "sigmoid":
        return "default: sigmoid output in float32"
    return None


# --- traversal ------------------------------------------------------------


def _children(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    # Keras 3 has no public recursive sublayer API; `_flatten_layers` is what
    # its own `Model.layers` uses. kmp only reads it.
    return [
        child
        for child in layer._flatten_layers(include_self=False, recursive=False)
        if not isinstance(child, keras.layers.InputLayer)
    ]


def _walk(model: keras.layers.Layer, prefix: str = ""):
    """Yields (path, layer) for every layer inside `model`, depth first."""
    for child in _children(model):
        path = f"{prefix}{child.name}"
        yield path, child
        yield from _walk(child, path + "/")


def _output_layers(model: keras.layers.Layer) -> set[int]:
    """ids of the layers that produce a model's outputs (through nesting)."""
    found: set[int] = set()
    if isinstance(model, keras.Sequential):
        children = _children(model)
        candidates = children[-1:] if children else []
    elif isinstance(model, keras.Model) and getattr(model, "_outputs", None):
        candidates = []
        for tensor in keras.tree.flatten(model.outputs):
            history = getattr(tensor, "_keras_history", None)
            if history is not None:
                candidates.append(history.operation)
    else:
        return found  # subclassed models have no static graph to read
    for op in candidates:
        if isinstance(op, keras.Model):
            found |= _output_layers(op)
        elif isinstance(op, keras.layers.Layer):
            found.add(id(op))
    return found


# --- the plan -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Applied:
    keras_name: str
    rule: str


# What kmp set on each layer, so that a later `prepare` can tell kmp's
# settings from a user's explicit `dtype=`. Weak: forgets deleted layers.
_applied: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_model_base: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class _Decision:
    layer: keras.layers.Layer
    path: str
    policy: policy_lib.Policy
    rule: str
    explicit: bool


def _base_policy(model: keras.layers.Layer) -> policy_lib.Policy:
    recorded = _model_base.get(model)
    if recorded is not None:
        return recorded
    return policy_lib.get(model.dtype_policy)


def _is_explicit(layer: keras.layers.Layer, base: policy_lib.Policy) -> bool:
    current = layer.dtype_policy
    if current.quantization_mode is not None:
        return True
    applied = _applied.get(layer)
    if applied is not None and applied.keras_name == current.name:
        return False
    return current.name != base.keras_name


def _match_rank(
    rules: list[LayerRule], layer: keras.layers.Layer, path: str
) -> LayerRule | None:
    matched = [r for r in rules if r.matches(layer, path)]
    if len({(r.policy.compute_dtype, r.policy.variable_dtype) for r in matched}) > 1:
        described = ", ".join(f"{r.describe()} -> {r.policy.name}" for r in matched)
        raise RuleConflictError(
            f"Layer {path!r} ({type(layer).__name__}) is matched by rules of "
            f"the same rank that disagree: {described}. Remove one with "
            "kmp.set_layer_policy(selector, None), or use a narrower selector."
        )
    return matched[0] if matched else None


def _plan(model: keras.layers.Layer) -> list[_Decision]:
    base = _base_policy(model)
    rules = layer_rules()
    name_rules = [r for r in rules if r.kind == "name"]
    class_rules = [r for r in rules if r.kind == "class"]
    decisions: list[_Decision] = []

    def decide(
        layer: keras.layers.Layer,
        path: str,
        inherited: policy_lib.Policy,
        is_output: bool,
        forced: tuple[policy_lib.Policy, str] | None,
    ) -> tuple[policy_lib.Policy, str, bool]:
        """Returns (policy, the rule that decided it, whether it is explicit)."""
        name_rule = _match_rank(name_rules, layer, path)
        class_rule = _match_rank(class_rules, layer, path)
        # Sublayers that kmp decides inside an attention layer were created by
        # Keras with the parent's policy, never by the user: not "explicit".
        if forced is None and _is_explicit(layer, base):
            return policy_lib.get(layer.dtype_policy), "explicit dtype=", True
        for rule in (name_rule, class_rule):
            if rule is not None:
                return rule.policy, rule.describe(), False
        if forced is not None:
            return forced[0], forced[1], False
        default = inherited.is_16bit and _default_rule(
            layer, is_output, inherited.compute_dtype
        )
        if default:
            return policy_lib.get(FLOAT32), default, False
        return inherited, ("policy" if inherited == base else "inherited"), False

    def walk(container, prefix, inherited, outputs, attention_base):
        for child in _children(container):
            path = f"{prefix}{child.name}"
            forced = None
            if attention_base is not None:
                if child.name in ("query", "key") or isinstance(
                    child, keras.layers.Softmax
                ):
                    forced = (policy_lib.get(FLOAT32), _ATTENTION_SCORES)
                else:
                    forced = (attention_base, "default: attention value/output")
            is_output = id(child) in outputs
            chosen, rule, explicit = decide(child, path, inherited, is_output, forced)
            if isinstance(child, keras.Model):
                # A nested model's layers inherit its decided policy; the
                # model's own policy is left alone (it casts no inputs).
                # `outputs` already reaches into nested models that produce
                # the top model's outputs (see _output_layers).
                walk(child, path + "/", chosen, outputs, None)
                continue
            decisions.append(_Decision(child, path, chosen, rule, explicit))
            scores_in_float32 = rule == _ATTENTION_SCORES and forced is None
            walk(
                child,
                path + "/",
                chosen,
                set(),
                inherited if scores_in_float32 else None,
            )

    walk(model, "", base, _output_layers(model), None)
    return decisions


def prepare(model: keras.layers.Layer) -> keras.layers.Layer:
    """Applies kmp's precision rules to a Keras model, in place.

    Works on Sequential, Functional, subclassed and nested models, built or
    not, through Keras's public `layer.dtype_policy` setter. Idempotent: a
    second call changes nothing. `kmp.compile` calls it for you.

    A layer of an attention class that is not built yet is put in float32 as
    a whole (its projections are created at build time); call `prepare` again
    once the model is built to return its value and output projections to
    the 16-bit dtype.

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
    ...     keras.layers.Dense(4, activation="softmax"),
    ... ]))
    >>> [layer.compute_dtype for layer in model.layers]
    ['float16', 'float32', 'float32']

    See also: `kmp.precision_report`, `kmp.set_layer_policy`, `kmp.compile`.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "prepare() expects a Keras model or layer. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    decisions = _plan(model)  # raises before anything is changed
    _model_base.setdefault(model, _base_policy(model))
    changed = 0
    for d in decisions:
        if d.explicit:
            continue
        if d.layer.dtype_policy.name != d.policy.keras_name:
            d.layer.dtype_policy = d.policy.keras_name
            changed += 1
        _applied[d.layer] = _Applied(d.policy.keras_name, d.rule)
    logger.debug("kmp.prepare(%s): %d layer policies changed", model.name, changed)
    return model


# --- the report -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerPrecision:
    """One row of a precision report."""

    path: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    rule: str


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Per layer: class, compute dtype, variable dtype and the deciding rule.

    `str(report)` is a table; `report.rows` is the data.
    """

    model_name: str
    policy: str
    rows: tuple[LayerPrecision, ...]

    def __iter__(self) -> Iterator[LayerPrecision]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, path: str) -> LayerPrecision:
        """Returns the row of the layer at `path` (its name at the top level)."""
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(
            f"No layer at path {path!r} in the report of {self.model_name!r}. "
            f"Paths: {', '.join(r.path for r in self.rows)}."
        )

    def __str__(self) -> str:
        table = format_table(
            ("layer", "class", "compute", "variables", "decided by"),
            [
                (r.path, r.class_name, r.compute_dtype, r.variable_dtype, r.rule)
                for r in self.rows
            ],
        )
        return (
            f"Precision of {self.model_name!r} (model policy: {self.policy})\n{table}"
        )


def _variable_dtype(layer: keras.layers.Layer) -> str:
    own = {v.dtype for v in layer.weights} if not _children(layer) else set()
    if len(own) == 1:
        return keras.backend.standardize_dtype(own.pop())
    return layer.variable_dtype


def precision_report(model: keras.layers.Layer) -> PrecisionReport:
    """Reports, per layer, the dtypes it computes and stores variables in, and
    the rule that decided them.

    The report shows the model as it is: run `kmp.prepare` (or `kmp.compile`)
    first to see kmp's rules applied.

    Args:
        model: A Keras model or layer.

    Returns:
        A `PrecisionReport`: `print()` it for a table, or read `.rows`.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = kmp.prepare(keras.Sequential(
    ...     [keras.Input((8,)), keras.layers.Dense(4, name="dense"),
    ...      keras.layers.Softmax(name="softmax")], name="tiny"))
    >>> print(kmp.precision_report(model))  # doctest: +NORMALIZE_WHITESPACE
    Precision of 'tiny' (model policy: mixed_bfloat16)
    layer    class    compute   variables  decided by
    -------  -------  --------  ---------  ---------------------------
    dense    Dense    bfloat16  float32    policy
    softmax  Softmax  float32   float32    default: softmax in float32
    >>> kmp.precision_report(model).row("softmax").compute_dtype
    'float32'

    See also: `kmp.prepare`.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "precision_report() expects a Keras model or layer. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    base = _base_policy(model)
    rows = []
    for path, child in _walk(model):
        if isinstance(child, keras.Model):
            continue
        applied = _applied.get(child)
        if applied is not None and applied.keras_name == child.dtype_policy.name:
            rule = applied.rule
        elif _is_explicit(child, base):
            rule = "explicit dtype="
        else:
            rule = "policy (kmp.prepare not applied)"
        rows.append(
            LayerPrecision(
                path,
                type(child).__name__,
                child.compute_dtype,
                _variable_dtype(child),
                rule,
            )
        )
    return PrecisionReport(model.name, base.name, tuple(rows))
