"""Precision rules: which layers compute in which dtype, and why.

Under a 16-bit policy most layers compute in float16/bfloat16. A few are
numerically sensitive, and kmp's rules say what to do with each. kmp applies
its decisions through Keras's public `layer.dtype_policy` setter (they take
effect at the layer's next call); `kmp.prepare` applies them and
`kmp.precision_report` shows them.

**The principle: interfaces keep their dtype.** In Keras a layer's policy
sets both the dtype it computes in and the dtype it returns, and TensorFlow
never promotes mixed dtypes in raw ops (`float32 + float16` raises). So a
rule may change how a layer computes, never the dtype of what it hands to
the next piece of user code:

* A float32 *island* (a layer put in float32 whole) is applied only where
  everything that consumes the layer's output absorbs a dtype change: in a
  Functional or Sequential graph, whose consumers are Keras layers (they
  cast their inputs) and `keras.ops` nodes that fix their output dtype or
  compute in their inputs' (then their own consumers are checked in turn;
  ops that do neither, such as `slice_update`, stop it). Inside a user's
  `Layer.call` the layer is left as it is, and `kmp.debug.precision_audit`
  names the risk with the fix to write there. (`kmp.precision.traversal.Site`
  records which case a layer is in.)
* Keras's normalization layers (`BatchNormalization`, `LayerNormalization`,
  `GroupNormalization`, `RMSNormalization`) already compute their
  statistics in float32 on 16-bit inputs and return the compute dtype: kmp
  leaves them alone, and its report says "float32 inside (Keras)". So do
  the KerasHub normalizations kmp knows to compute in float32 inside
  (T5's computes in the compute dtype).
* The model's outputs become float32. Where they go to Keras's loss,
  metrics and `predict`, the output is cast there: the layer that produces
  it keeps its policy (Keras's losses and metrics cast what they receive,
  and kmp's `predict` casts what it returns, as TensorFlow's guide's
  `Activation('linear', dtype='float32')` would). An output layer with a
  sigmoid activation computes in float32: Keras's binary crossentropy
  reads the logits it keeps, which a cast drops. Where the outputs go to a
  model's own `train_step` or `compute_loss` (or to a model such code
  calls), which kmp cannot cast in, the output layer computes in float32;
  a custom layer with code of its own keeps its policy there, and the
  audit says how to cast its output.
* Attention (`MultiHeadAttention`, `GroupQueryAttention` and subclasses that
  keep Keras's attention code): the rule changes only sublayers whose
  outputs Keras's own attention code consumes with `keras.ops` that promote,
  so the layer returns the dtype it returned before. Its softmax's output is
  the scores it returns with `return_attention_scores=True`: the softmax
  changes wherever those scores stay inside the layer (kmp traces the model
  to see it when user code calls the layer) or reach consumers that absorb
  a dtype change, and keeps its policy only where they reach user code.
  What it does is set by `kmp.rules.set_attention_scores`.

Resolution order, for each float layer (first match wins):

1. An explicit `dtype=` given to the layer's constructor (detected as a policy
   that differs from the model's and was not set by kmp).
2. A layer-name rule: `kmp.set_layer_policy("name:<glob>", policy)`, matched
   against the layer's name and its path inside the model (`"block/attn"`).
3. A class rule: `kmp.set_layer_policy(LayerClass, policy)` (the class and
   its subclasses) or `kmp.set_layer_policy("class:<glob>", policy)` (matched
   against the layer's class name).
4. kmp's defaults, which apply only where the policy in force computes in a
   16-bit dtype: the layer kinds kmp knows (the precision report says what
   kmp does with each, and why), and the output rule above.
5. The policy of the enclosing layer: the model's own policy at the top, and a
   container layer's decided policy for the layers inside it (so
   `kmp.set_layer_policy(MyBlock, "float32")` puts the whole block in float32).

A user rule (ranks 2 and 3) is the user's explicit choice and is applied
wherever it matches, also where it changes what a layer returns. Two rules
of the same rank that match one layer and disagree raise `RuleConflictError`;
`prepare` then changes nothing. Layers whose policy is not a float policy
(`Hashing`, `StringLookup`, integer preprocessing) and quantized layers are
left as they are.

Attention scores (`set_attention_scores`): under float16 the default is
`"float32"`: the query and key projections, the scores and the softmax
compute in float32, the value and output projections (and dropout) in
float16. Keras multiplies query by key in the compute dtype, so float16
logits overflow to inf (and the output to NaN) at inputs of scale 100-300;
bfloat16 has float32's range and cannot overflow there. Under bfloat16 the
default is `"compute"`, Keras's own attention: 16-bit projections and
scores, with the softmax in float32 on Keras's fused path. Accurate scores
under bfloat16 need unrounded query *and* key projections (one rounded to
bfloat16 already gives Keras's error at large logits), and two float32
projections cost more step time than a bfloat16 model can give back (see
benchmarks/attention_rule.py); `set_attention_scores("float32")` buys that
accuracy for users who want it.

One speed rule: under float16 on a machine with no GPU or TPU, convolutions
compute in float32 where their consumers cast (TensorFlow's float16 CPU
convolutions are slow both with and without native float16 math), which
`kmp.rules.set_cpu_convolutions("memory")` turns off.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import threading
from typing import Any

import keras

from kmp._base import warn as _warn
from kmp.precision import names
from kmp.precision import policy as policy_lib

logger = logging.getLogger("kmp")

FLOAT32 = "float32"


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
    resolution order. A user rule is applied wherever it matches, also where
    the new policy changes the dtype the layer returns.

    A `'class:<glob>'` pattern that matches no layer class defined so far
    (a typo such as `'class:Konv2D'`) is reported with a warning naming the
    closest class names; `kmp.prepare` warns the same way about a rule that
    matches no layer of the model it prepares.

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
    >>> kmp.set_layer_policy("name:hidden", "float32")
    LayerRule(kind='name', selector='hidden', policy=<Policy "float32": ...>)
    >>> model = keras.Sequential([keras.Input((8,)),
    ...                           keras.layers.Dense(16, name="hidden"),
    ...                           keras.layers.Dense(16), keras.layers.Dense(4)])
    >>> [layer.compute_dtype for layer in kmp.prepare(model).layers]
    ['float32', 'float16', 'float16']

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
    if kind == "class" and isinstance(parsed, str):
        known = names.known_layer_class_names()
        if not any(fnmatch.fnmatchcase(n, parsed) for n in known):
            _warn.warn(unmatched_message(rule, known, "class defined so far"))
    return rule


def unmatched_message(rule: LayerRule, candidates: Any, where: str) -> str:
    """Says that `rule` matches nothing in `where`, with the closest names."""
    pattern = rule.selector if isinstance(rule.selector, str) else ""
    near = names.closest(pattern.replace("*", "").replace("?", ""), candidates)
    hint = (
        f" Closest {'class names' if rule.kind == 'class' else 'names'}: "
        f"{', '.join(near)}."
        if near
        else ""
    )
    return f"kmp: {rule.describe()} matches no layer {where}.{hint}"


def layer_rules() -> list[LayerRule]:
    """Returns the user rules set with `kmp.set_layer_policy`.

    Example:

    >>> kmp.set_layer_policy(keras.layers.Conv2D, "float32")
    LayerRule(kind='class', selector=<class '...Conv2D'>, policy=...)
    >>> [rule.describe() for rule in kmp.precision.rules.layer_rules()]
    ['rule Conv2D']
    """
    with _rules_lock:
        return list(_rules.values())


def clear_layer_policies() -> None:
    """Removes every rule set with `kmp.set_layer_policy`.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> kmp.set_layer_policy("name:hidden", "float32")
    LayerRule(...)
    >>> kmp.clear_layer_policies()
    >>> model = kmp.prepare(keras.Sequential([
    ...     keras.Input((4,)), keras.layers.Dense(4, name="hidden"),
    ...     keras.layers.Dense(1)]))
    >>> model.get_layer("hidden").compute_dtype
    'bfloat16'
    """
    with _rules_lock:
        _rules.clear()
