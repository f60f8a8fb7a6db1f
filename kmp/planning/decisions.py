"""The precision plan of a model: one decision per layer.

`plan(model)` decides every layer's policy by the rules of `kmp.rules` (see
`kmp.precision.rules` for the order and the reasons) and the layer kinds of
`kmp.precision.kinds`, from where each layer sits (`kmp.precision.traversal`)
and what its ops compute in (`kmp.backend.tracing`), and leaves the model as
it was; `kmp.planning.apply` applies it. `kmp.precision_report` and
`kmp.debug.precision_audit` read the same plan, so what they say is what
`kmp.prepare` does.
"""

from __future__ import annotations

import dataclasses
import logging

import keras

from kmp.backend import machine
from kmp.backend import tracing
from kmp.planning import token_ids
from kmp.planning.applied import applied
from kmp.planning.applied import base_policy
from kmp.precision import attention
from kmp.precision import convolutions
from kmp.precision import kinds
from kmp.precision import policy as policy_lib
from kmp.precision import quantization
from kmp.precision import rules
from kmp.precision import traversal

logger = logging.getLogger("kmp")

# Rule texts shown in reports.
EXPLICIT = "explicit dtype="
POLICY = "policy"
INHERITED = "inherited"
OUTPUT = "default: model output cast to float32"
SIGMOID_OUTPUT = "default: sigmoid output in float32"
STEP_OUTPUT = "default: output its training step receives, in float32"
CALLED_OUTPUT = "default: output of a model user code calls, in float32"
FLOAT32_OUTPUTS = (SIGMOID_OUTPUT, STEP_OUTPUT, CALLED_OUTPUT)
NOT_FLOAT = "not a float layer: left as is"
ATTENTION_SCORES = "default: attention scores in float32"
TOKEN_IDS = "default: float32 inputs (token ids stay exact)"
SCORES_KEPT = "default: attention softmax 16-bit (its scores may reach user code)"
CPU_CONVOLUTIONS = "default: float16 convolutions are slow on CPUs"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What kmp decided for one layer.

    Attributes:
        site: Where the layer sits (`kmp.precision.traversal.Site`).
        policy: The policy it computes in after `prepare`; None for a layer
            kmp leaves alone because its policy is not a float policy.
        rule: What decided it (`'policy'`, `'explicit dtype='`,
            `'rule Dense'`, `'default: softmax in float32'`, ...).
        kind: Its `LayerKind` and the kind's source, if known.
        explicit: True when the user gave the layer its own `dtype=`.
        note: Why a default did not apply here, if it did not.
    """

    site: traversal.Site
    policy: policy_lib.Policy | None
    rule: str
    kind: tuple[kinds.LayerKind, str] | None = None
    explicit: bool = False
    note: str = ""

    @property
    def path(self) -> str:
        return self.site.path

    @property
    def layer(self) -> keras.layers.Layer:
        return self.site.layer


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every layer's decision, in traversal order.

    Attributes:
        model: The model planned.
        base: The policy the model computes in (or the policy it was
            planned for, with `plan(model, policy=...)`).
        decisions: One `Decision` per layer (nested models' own entries
            left out: they cast no inputs).
        unmatched: User rules that match no layer of this model.
        unbuilt_attention: Paths of attention layers not built yet, whose
            scores rule could not be applied.
    """

    model: keras.layers.Layer
    base: policy_lib.Policy
    decisions: tuple[Decision, ...]
    unmatched: tuple[rules.LayerRule, ...] = ()
    unbuilt_attention: tuple[str, ...] = ()

    def __iter__(self):
        return iter(self.decisions)

    def decision(self, path: str) -> Decision:
        """The decision for the layer at `path`."""
        for d in self.decisions:
            if d.path == path:
                return d
        raise KeyError(
            f"No layer at path {path!r} in {self.model.name!r}. Paths: "
            f"{', '.join(d.path for d in self.decisions)}."
        )

    @property
    def computes_in_float16(self) -> bool:
        """True when any layer computes in float16 (loss scaling is needed)."""
        return any(
            d.policy is not None and d.policy.compute_dtype == "float16"
            for d in self.decisions
        )

    @property
    def computes_in_16bit(self) -> bool:
        """True when any layer computes in float16 or bfloat16."""
        return any(d.policy is not None and d.policy.is_16bit for d in self.decisions)


def is_float_layer(layer: keras.layers.Layer) -> bool:
    """False for layers kmp must leave alone: a non-float policy (Hashing,
    StringLookup, integer preprocessing). A quantized layer is a float layer
    here: kmp decides the float policy it computes in around its quantized
    weights (`kmp.precision.quantization`)."""
    # Preprocessing layers may compute in another dtype than their policy's
    # (StringLookup: 'string'); `compute_dtype` is what they run in.
    return keras.backend.is_float_dtype(layer.compute_dtype)


def is_explicit(layer: keras.layers.Layer, base: policy_lib.Policy) -> bool:
    """Whether `layer`'s policy is the user's own setting: one that differs
    from the model's, that kmp did not set, and that no `DTypePolicyMap`
    gives it (a saved plan's, or KerasHub's)."""
    if applied(layer) is not None:
        return False
    if isinstance(layer.dtype_policy, keras.dtype_policies.DTypePolicyMap):
        return False
    return quantization.float_part(layer) != base.keras_name


def _float16_convolutions_are_slow() -> bool:
    """True on machines that train on the CPU, where float16 convolutions
    were measured slow with and without native float16 math."""
    caps = machine.capabilities()
    return not caps.gpus and not caps.tpus


def _match_rank(rank, layer, path, seen: set[int]):
    matched = [r for r in rank if r.matches(layer, path)]
    seen.update(id(r) for r in matched)
    if len({(r.policy.compute_dtype, r.policy.variable_dtype) for r in matched}) > 1:
        described = ", ".join(f"{r.describe()} -> {r.policy.name}" for r in matched)
        raise rules.RuleConflictError(
            f"Layer {path!r} ({type(layer).__name__}) is matched by rules of "
            f"the same rank that disagree: {described}. Remove one with "
            "kmp.set_layer_policy(selector, None), or use a narrower selector."
        )
    return matched[0] if matched else None


def _where(site: traversal.Site) -> str:
    """Why a layer's output dtype must not change, in words."""
    if site.in_graph and site.blocker:
        return (
            f"its output goes to {site.blocker}, which does not absorb a dtype change"
        )
    return f"its output goes to code in {traversal.code_of(site.user_code)}"


def plan(
    model: keras.layers.Layer, policy: str | policy_lib.Policy | None = None
) -> Plan:
    """Decides every layer's policy by kmp's rules from the model's
    structure, the rules and at most one read-only trace of the model at
    its layers' own policies (`kmp.backend.tracing.forward`: what a
    subclassed model returns, what code meets an output, whether an
    attention layer hands out its scores, whether a layer hands token ids
    only to its sublayers). It changes nothing.

    Args:
        model: A Keras model or layer.
        policy: Plan as if the model computed in this policy: layers on the
            model's own policy move to it, layers with their own `dtype=`
            keep theirs. By default, the model's policy.

    Returns:
        A `Plan`.

    Raises:
        TypeError: if `model` is not a Keras layer or model.
        RuleConflictError: if two rules of the same rank disagree.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="d"),
    ...                           keras.layers.Dense(2, name="head")])
    >>> [(d.path, d.policy.name) for d in kmp.planning.decisions.plan(model)]
    [('d', 'mixed_bfloat16'), ('head', 'mixed_bfloat16')]
    >>> kmp.planning.decisions.plan(model).decision("head").rule
    'default: model output cast to float32'
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "Expected a Keras model or layer. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    kinds.warn_unresolved_hub_classes()
    actual_base = base_policy(model)
    base = actual_base if policy is None else policy_lib.get(policy)
    user_rules = rules.layer_rules()
    name_rules = [r for r in user_rules if r.kind == "name"]
    class_rules = [r for r in user_rules if r.kind == "class"]
    matched_rules: set[int] = set()
    decisions: list[Decision] = []
    unbuilt: list[str] = []
    decided: dict[int, policy_lib.Policy] = {id(model): base}
    forced: dict[int, tuple[policy_lib.Policy, str, str]] = {}
    scores_inside: frozenset[int] | None = None  # read once, when needed
    traced = _OneTrace(model)
    sites = _sites(model, base, traced)
    inherited_at: dict[int, policy_lib.Policy] = {}

    for site in sites:
        layer, path = site.layer, site.path
        inherited = decided.get(id(site.parent), base)
        inherited_at[id(layer)] = inherited
        if not is_float_layer(layer):
            decisions.append(Decision(site, None, NOT_FLOAT, kinds.kind_of(layer)))
            continue
        name_rule = _match_rank(name_rules, layer, path, matched_rules)
        class_rule = _match_rank(class_rules, layer, path, matched_rules)
        user_rule = name_rule or class_rule
        if traversal.is_graph(layer):
            # A nested model casts no inputs: only its layers are decided,
            # by a rule on it or else as its surroundings.
            decided[id(layer)] = user_rule.policy if user_rule else inherited
            continue
        kind = kinds.kind_of(layer)
        note = ""
        # Layers on the model's policy move with it (to `policy` when one is
        # given); a layer with its own dtype= keeps it.
        explicit = id(layer) not in forced and is_explicit(layer, actual_base)
        if explicit:
            chosen, rule = policy_lib.get(quantization.float_policy(layer)), EXPLICIT
        elif user_rule:
            chosen, rule = user_rule.policy, user_rule.describe()
        elif id(layer) in forced:
            chosen, rule, note = forced[id(layer)]
        elif is_keras_attention(site.parent):
            # Keras's attention code consumes its sublayers: the scores rule
            # above decides them, or they stay as Keras made them.
            chosen, rule = inherited, INHERITED if inherited != base else POLICY
        else:
            chosen, rule, note = _default(site, kind, inherited, base, model, traced)
        kept = _refused_float_part(layer, chosen)
        if kept is not None:
            chosen, rule, note = kept
        # Only the container's own input cast changes: its layers keep theirs.
        decided[id(layer)] = inherited if rule == TOKEN_IDS else chosen
        decisions.append(Decision(site, chosen, rule, kind, explicit, note))
        if rule == ATTENTION_SCORES and id(layer) not in forced:
            inside = site.casts_downstream
            if not inside:
                if scores_inside is None:
                    scores_inside = _scores_stay_inside(model, inherited, traced)
                inside = id(layer) in scores_inside
            forced.update(_attention_sublayers(site, inherited, inside))
        elif (
            kind is not None
            and kind[0].action == kinds.SCORES
            and rule in (POLICY, INHERITED)
            and _scores_in_float32(layer, inherited)
            and not layer.built
        ):
            unbuilt.append(path)
    decisions = _checked_outputs(model, decisions, inherited_at, base, traced)
    unmatched = tuple(r for r in user_rules if id(r) not in matched_rules)
    return Plan(model, base, tuple(decisions), unmatched, tuple(unbuilt))


def has_no_call(model) -> bool:
    """A subclassed model with no `call` of its own: it trains with its
    `train_step` (or `compute_loss`), calling the models it holds."""
    return (
        isinstance(model, keras.Model)
        and not traversal.is_graph(model)
        and not runs_own_call(model)
    )


def runs_own_call(model) -> bool:
    """Whether calling `model` runs code of its own: a custom layer, or a
    subclassed model with a `call` (a GAN or a VAE written with a
    `train_step` only has none)."""
    return not traversal.is_graph(model) and traversal.has_own_call(model)


class _OneTrace:
    """The one read-only trace of a model a plan reads (`tracing.forward`),
    made the first time a choice needs it."""

    def __init__(self, model):
        self._model = model
        self._forward: tracing.Forward | None = None

    def get(self) -> tracing.Forward:
        if self._forward is None:
            self._forward = tracing.forward(self._model)
        return self._forward


def _sites(model, base, traced: _OneTrace):
    """The model's sites, with the outputs a subclassed model hands to its
    training code marked as model outputs, as a Functional model's are:

    * a model with no `call` (a VAE, a GAN: a `train_step` only): the
      outputs of every Functional or Sequential model it holds;
    * a model with a `call`, once built: one trace of it shows which
      sublayer produces what it returns (a layer, or a model whose outputs
      are then outputs), and, where the model has its own `train_step` or
      `compute_loss`, which models it holds that `call` never runs (a
      distiller's teacher, called in `compute_loss`): their outputs too.
      A model `call` runs for its own ends (a block, a backbone) is left.

    Checked again, with their new dtype, by `_checked_outputs`."""
    if (
        traversal.is_graph(model)
        or not isinstance(model, keras.Model)
        or not base.is_16bit
    ):
        return list(traversal.walk(model))
    graphs = {id(c) for c in traversal.children(model) if traversal.is_graph(c)}
    if has_no_call(model):
        return list(traversal.walk(model, frozenset(graphs)))
    sources = tracing.output_sources(model, traced.get())
    if sources.error:
        return list(traversal.walk(model))
    # A model its call does not run goes to the model's own training code
    # (a distiller's teacher in compute_loss), where it has some.
    own_training = bool(traversal.training_code(model))
    called = {
        key
        for key in graphs
        if key in sources.layers or (own_training and key not in sources.ran)
    }
    return [
        dataclasses.replace(
            s, model_output=True, output_of=model, casts_downstream=True
        )
        if s.parent is model
        and id(s.layer) in sources.layers
        and not traversal.is_graph(s.layer)
        else s
        for s in traversal.walk(model, frozenset(called))
    ]


def _checked_outputs(model, decisions, inherited_at, base, traced: _OneTrace):
    """The decisions, with a float32 output that user code receives (a
    subclassed model's output, a model its code calls) checked on the plan's
    trace of `model`: where that code would meet it, in float32, with a
    16-bit tensor (raw TensorFlow ops do not promote), or the model cannot
    be traced, it keeps its policy and says why. A model not built yet
    keeps the choices: kmp.compile completes the plan when fit has built
    it."""
    # The code of a model that has no call of its own (only a train_step)
    # is never traced: its nested models' outputs go to it as a top
    # model's go to the loss.
    checked = [
        i
        for i, d in enumerate(decisions)
        if changes_an_output(d)
        and d.site.user_code is not None
        and (d.site.user_code is not model or runs_own_call(model))
    ]
    if not checked or not tracing.traceable(model):
        return decisions
    forward = traced.get()
    result = list(decisions)
    for i in checked:
        d = decisions[i]
        if forward.error:
            why = f"kmp could not trace {type(model).__name__}.call ({forward.error})"
        else:
            meets = tracing.float32_output_mixes(model, forward, d.layer)
            if meets is None:
                continue
            why = (
                f"in float32 it would meet a 16-bit tensor in {meets} (raw "
                "TensorFlow and jax.lax ops do not mix dtypes)"
            )
        result[i] = _given_back(d, inherited_at[id(d.layer)], base, why)
    return result


def changes_an_output(d: Decision) -> bool:
    """Whether a default of kmp's computes a model output in float32 (its
    output rules, or a kind's rule on a layer that produces one): the
    dtype it returns changes."""
    return (
        d.site.model_output
        and d.policy is not None
        and d.policy.compute_dtype == rules.FLOAT32
        and d.rule.startswith("default:")
    )


def _given_back(d: Decision, inherited, base, why: str) -> Decision:
    """`d` with its layer's own policy back, in place of a float32 output
    that user code cannot take (`why`)."""
    return dataclasses.replace(
        d,
        policy=inherited,
        rule=POLICY if inherited == base else INHERITED,
        note=f"an output user code receives, but {why}",
    )


def _refused_float_part(layer, chosen):
    """(policy, rule, note) for a quantized layer whose chosen float part
    Keras refuses (int8 in float16): it keeps its own float part, or float32
    if that is refused too. None when the choice stands."""
    mode = quantization.mode(layer)
    why = quantization.refusal(mode, chosen.compute_dtype)
    if why is None:
        return None
    own = policy_lib.get(quantization.float_policy(layer))
    kept = own if quantization.refusal(mode, own.compute_dtype) is None else None
    kept = kept or policy_lib.get(rules.FLOAT32)
    return (
        kept,
        f"{mode}: kept in {kept.compute_dtype}",
        f"{why}; for 16-bit compute use mixed_bfloat16, or quantize the "
        "float model to int4 or float8 instead",
    )


def _default(site, kind, inherited, base, top, traced):
    """(policy, rule, note) from kmp's defaults for one layer."""
    plain = (inherited, POLICY if inherited == base else INHERITED, "")
    if not inherited.is_16bit:
        return plain
    float32 = policy_lib.get(rules.FLOAT32)
    layer = site.layer
    if site.model_output:
        decided = _output(site, kind, inherited, plain, top)
        if decided is not None:
            return decided
    if site.reads_float_input and token_ids.rounds_token_ids(layer):
        # A float keras.Input carries token ids into an Embedding through a
        # layer that would cast them to 16-bit (rounding ids above 256 or
        # 2048). In float32 the layer passes them on exactly; applied only
        # where its code hands them only to its sublayers (read from the
        # plan's trace), so that it still returns what it returned.
        if token_ids.passes_ids_on(traced.get(), layer):
            return float32, TOKEN_IDS, ""
        return (
            *plain[:2],
            "its float input reaches an Embedding; casting it "
            "to float32 would change what it returns",
        )
    if kind is None:
        return plain
    what = kind[0]
    action = what.action
    if action == kinds.CPU_FLOAT16:
        if (
            inherited.compute_dtype != "float16"
            or not _float16_convolutions_are_slow()
            or convolutions.cpu_convolutions() == "memory"
        ):
            return plain
        action = kinds.ISLAND
    if action == kinds.ISLAND:
        if site.casts_downstream:
            name = kinds.activation_name(layer) or what.name
            if what.action == kinds.CPU_FLOAT16:
                return float32, CPU_CONVOLUTIONS, ""
            return float32, f"default: {name} in float32", ""
        return (*plain[:2], f"left {inherited.compute_dtype}: {_where(site)}")
    if action == kinds.SCORES and layer.built and _scores_in_float32(layer, inherited):
        # The layer casts its inputs to float32 (query and key see them
        # unrounded); its output projection keeps its output 16-bit.
        return float32, ATTENTION_SCORES, ""
    return plain


def _output(site, kind, inherited, plain, top):
    """(policy, rule, note) for a layer that produces a model output, or
    None where its kind's rule decides (a softmax).

    Where the output goes to Keras's loss, metrics and `predict` (a model
    trained by Keras's own `train_step` and `compute_loss`: what its call
    returns, from its own layers or from a model it holds), the layer keeps
    its policy and the output is cast to float32 there: Keras's losses and
    metrics cast what they receive, and kmp's `predict` casts what it
    returns (`kmp.backend.outputs`). A sigmoid computes in float32: Keras's
    binary crossentropy reads the logits it keeps, which a cast drops.
    Where the output goes to code kmp does not run (a `train_step`, a model
    that code calls, the caller of a layer), kmp cannot cast it: a Keras
    layer computes in float32, a layer with code of its own keeps its
    policy and the audit names it."""
    float32 = policy_lib.get(rules.FLOAT32)
    to_keras = isinstance(top, keras.Model) and not traversal.training_code(top)
    cast = (inherited, OUTPUT, "")
    if not site.casts_downstream:
        if to_keras:  # the layer keeps its policy: only the output is cast
            return cast
        return (*plain[:2], "a model output, but " + _where(site))
    if kinds.ends_in_sigmoid(site.layer):
        return float32, SIGMOID_OUTPUT, ""
    if to_keras:
        if kind is None or kind[0].action == kinds.KEEP:
            return cast
        return None
    if kind is None and traversal.children(site.layer):
        return (
            *plain[:2],
            "a model output your training code receives, from a layer with "
            "code of its own: kmp cannot cast it there",
        )
    return float32, STEP_OUTPUT if site.output_of is top else CALLED_OUTPUT, ""


def is_keras_attention(layer) -> bool:
    kind = kinds.kind_of(layer) if layer is not None else None
    return (
        kind is not None
        and kind[0].action == kinds.SCORES
        and kinds.keeps_keras_attention_code(layer)
    )


def _scores_in_float32(layer, inherited) -> bool:
    """Whether the attention scores rule computes this layer's scores in
    float32 (Keras's own attention code, mode 'float32' for the dtype)."""
    mode = attention.attention_scores(inherited.compute_dtype)
    return mode == rules.FLOAT32 and kinds.keeps_keras_attention_code(layer)


def _attention_sublayers(site, inherited, scores_inside: bool):
    """{id(sublayer): (policy, rule, note)} for Keras's attention under the
    scores rule: query, key and softmax in float32, the rest in `inherited`.
    The softmax's output is the scores the layer returns with
    `return_attention_scores=True`: where they reach user code
    (`scores_inside` False) it keeps `inherited`, so that they keep their
    dtype."""
    float32 = policy_lib.get(rules.FLOAT32)
    forced = {}
    for child in traversal.children(site.layer):
        softmax = isinstance(child, keras.layers.Softmax)
        if child.name in ("query", "key") or (softmax and scores_inside):
            forced[id(child)] = (float32, ATTENTION_SCORES, "")
        elif softmax:
            dtype = inherited.compute_dtype
            overflow = (
                ", where logits above 65504 overflow" if dtype == "float16" else ""
            )
            forced[id(child)] = (
                inherited,
                SCORES_KEPT,
                f"its output is the scores the layer may hand to user code "
                f"({_where(site)}; return_attention_scores=True, or kmp could not "
                f"trace the model), which keep their dtype: it computes in "
                f"{dtype}{overflow}; kmp.set_layer_policy('name:{site.path}/"
                f"{child.name}', 'float32') computes it in float32 and hands "
                "over float32 scores",
            )
        else:
            forced[id(child)] = (inherited, "default: attention value/output", "")
    return forced


def _scores_stay_inside(model, inherited, traced: _OneTrace) -> frozenset[int]:
    """ids of the Keras attention layers in `model`, outside graphs that
    absorb their dtype, whose scores (their softmax's output) do not leave
    them: their callers did not ask for them, so a float32 softmax changes
    nothing the callers receive. Read from the plan's trace of `model`;
    empty when it cannot be traced."""
    sites = [
        s
        for s in traversal.walk(model)
        if is_keras_attention(s.layer)
        and not s.casts_downstream
        and s.layer.built
        and _scores_in_float32(s.layer, inherited)
    ]
    if not sites:
        return frozenset()
    forward = traced.get()
    if forward.error:
        return frozenset()
    return frozenset(
        id(s.layer)
        for s in sites
        if not any(
            tracing.hands_out(forward, s.layer, child)
            for child in traversal.children(s.layer)
            if isinstance(child, keras.layers.Softmax)
        )
    )
