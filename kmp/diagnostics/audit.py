"""`kmp.debug.precision_audit`: the spots where 16-bit precision may hurt a
model, named before training, each with its fix.

The audit plans the model as `kmp.prepare` would (`kmp.planning`), traces
one forward pass in the state the model is in (`kmp.backend.tracing`), and reads
both: what `prepare` would change (fix: `prepare`, which keeps every
interface), what kmp must leave 16-bit because user code consumes it (fix:
the line to write there), and what a layer's own code computes in 16-bit
(softmaxes and query x key products: a custom attention, KerasHub's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from kmp._base.table import format_table
from kmp.backend import drift
from kmp.backend import ranges
from kmp.backend import tracing
from kmp.diagnostics import compiled_by
from kmp.internals import keras_private
from kmp.planning import applied as applied_lib
from kmp.planning import decisions as planning
from kmp.planning import token_ids
from kmp.precision import attention
from kmp.precision import kinds
from kmp.precision import policy as policy_lib
from kmp.precision import quantization
from kmp.precision import traversal

_SIXTEEN = policy_lib.SIXTEEN_BIT
FLOAT16_MAX = policy_lib.FLOAT16_MAX
# A layer within this factor of float16's largest value is named.
DEFAULT_HEADROOM = 2.0


@dataclasses.dataclass(frozen=True)
class Risk:
    """One risky spot found by `precision_audit`."""

    layer: str
    class_name: str
    kind: str
    detail: str
    fix: str


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The risks `precision_audit` found; `str()` is a table.

    Attributes:
        model_name: The model's name.
        risks: One `Risk` per spot.
        not_traced: Why the model could not be traced (then the risks only a
            trace finds are missing), or `''`.
        not_traced_fix: What to do so that it can be, where kmp knows.
    """

    model_name: str
    risks: tuple[Risk, ...]
    not_traced: str = ""
    not_traced_fix: str = ""

    def __iter__(self):
        return iter(self.risks)

    def __len__(self) -> int:
        return len(self.risks)

    def kinds(self) -> set[str]:
        return {r.kind for r in self.risks}

    def __str__(self) -> str:
        lines = []
        if self.not_traced:
            fix = f" {self.not_traced_fix}" if self.not_traced_fix else ""
            lines.append(
                f"Could not check all of {self.model_name!r}: kmp could not trace "
                f"it ({self.not_traced.rstrip('.')}), so what only a trace shows "
                "(softmaxes and attention scores inside layers' own code, the "
                f"dtype of its outputs, code that mixes dtypes) is unchecked.{fix}"
            )
        if self.risks:
            table = format_table(
                ("layer", "class", "risk", "detail", "fix"),
                [(r.layer, r.class_name, r.kind, r.detail, r.fix) for r in self.risks],
            )
            lines.append(f"Precision risks in {self.model_name!r}:\n{table}")
        elif self.not_traced:
            lines.append("No precision risks found in the parts kmp could check.")
        else:
            lines.append(f"No precision risks found in {self.model_name!r}.")
        return "\n".join(lines)


def precision_audit(
    model: keras.Model,
    policy: Any = None,
    *,
    sample: Any = None,
    headroom: float = DEFAULT_HEADROOM,
) -> AuditReport:
    """Lists, before training, the spots where 16-bit precision may hurt.

    The audit plans the model as `kmp.prepare` would (under `policy` if
    given), traces one forward pass (nothing runs), and names:

    * sensitive layers and outputs `kmp.prepare` would change but has not yet
      (the fix: `kmp.prepare`, which never changes what a layer hands to
      your code);
    * sensitive layers kmp leaves 16-bit because your code consumes their
      output, with the line to write there;
    * softmaxes and query x key products computed in 16-bit inside a layer's
      own code (a custom attention, KerasHub's attention);
    * a float `keras.Input` whose token ids are rounded to 16-bit on their
      way to an `Embedding`;
    * model outputs that a model's own `train_step` or `compute_loss`
      receives in 16-bit (a subclassed model's, a custom output layer's);
    * user-written layers that fail with a dtype error under the policy;
    * Dense/Conv/Embedding sizes that are not multiples of 8, which keeps
      GPU Tensor Cores from being used;
    * with a `sample` batch: every layer whose activations on it reach
      float16's largest value (65504), or come within a factor `headroom`
      of it, measured by one forward pass with every layer in float32
      (the model's policies are restored after).
      Such a layer overflows in float16 whatever the loss scale: the fix
      is that layer in float32, or bfloat16 (float32's range) where the
      layer keeps its precision in bfloat16;
    * with a `sample` batch, under a 16-bit policy: every layer whose
      results on it differ from float32's by far more than 16-bit rounding
      and its inputs explain (the model run once at its policies and once
      in float32). Such a layer cancels, or takes inputs with more digits
      than 16 bits hold. It trains to a worse loss with no NaN and no
      skipped step. The fix is that layer (and where needed the layers
      that feed it) in float32, or `@kmp.float32_scope` around the part of
      its own code that cancels.

    Args:
        model: A built Keras model.
        policy: Audit as if the model ran under this policy (a name or
            `kmp.Policy`), e.g. a float32 model you plan to move to
            `'mixed_float16'`: the layers that follow the model's policy move
            to it, as before `kmp.prepare`. By default, the model as it is.
        sample: A batch of inputs, as the model takes them (real data:
            activations on random inputs can differ by orders of
            magnitude), for the activation range and precision checks.
            None: no check.
        headroom: With `sample`, a layer is named when its activations
            reach `65504 / headroom` (the default 2: within a factor 2 of
            float16's limit, as other batches and training can raise them).
            At least 1.

    Returns:
        An `AuditReport`; `print()` it.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10),
    ...                           keras.layers.Softmax(),
    ...                           keras.layers.Dense(4, activation="sigmoid")])
    >>> sorted(kmp.debug.precision_audit(model).kinds())
    ['16-bit output', '16-bit softmax', 'size not a multiple of 8']
    >>> sorted(kmp.debug.precision_audit(kmp.prepare(model)).kinds())
    ['size not a multiple of 8']
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "precision_audit() expects a Keras model. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    if policy is not None and not isinstance(policy, (str, policy_lib.Policy)):
        policy_type = type(policy).__name__
        if isinstance(policy, (np.ndarray, dict, list, tuple)) or keras.ops.is_tensor(
            policy
        ):
            raise TypeError(
                "precision_audit()'s second argument is the policy to audit "
                f"under; received a {policy_type}. Pass a batch as "
                "precision_audit(model, sample=batch)."
            )
    if not (isinstance(headroom, (int, float)) and headroom >= 1):
        raise ValueError(
            "precision_audit(headroom=...) is the factor below float16's "
            "largest value at which a layer is named: a number of at least 1 "
            f"(1: only layers that reach it). Received: {headroom!r}."
        )
    compiled_by.note_compiled_without_kmp(model, "kmp.debug.precision_audit")
    target = None if policy is None else policy_lib.get(policy)
    the_plan = planning.plan(model, policy=target)
    risks: list[Risk] = []
    with _Moved(the_plan, target):
        traced, error, fix = _trace(model)
        for d in the_plan:
            risks.extend(_layer_risks(d, traced.of(d.path)))
        if the_plan.base.is_16bit:
            risks.extend(_token_id_risks(model, the_plan))
            if traversal.training_code(model) and not any(
                r.kind == "16-bit output" for r in risks
            ):
                # Where Keras's loss takes the outputs, it casts them.
                risks.extend(_output_risks(model, traced))
        risks.extend(_mixed_dtype_risks(model, traced))
        if sample is not None:
            # Under the policy audited: its 16-bit ops are the ones counted.
            range_risks, range_error = range_check(model, sample, headroom)
            precision_risks, precision_error = precision_check(model, sample)
            risks.extend(range_risks + precision_risks)
            sample_error = range_error or precision_error
            if sample_error and not error:
                error = f"it could not run on the sample ({sample_error})"
    return AuditReport(model.name, tuple(risks), error, fix)


def precision_check(
    model: keras.layers.Layer, sample: Any, policy: str | None = None
) -> tuple[list[Risk], str]:
    """The layers whose results on `sample`, at their policies, move from
    float32's by far more than 16-bit rounding and their inputs explain
    (`kmp.backend.drift`), as risks with the fix that works, and why the
    passes could not run (or `''`). Nothing for a model that computes
    nothing in 16-bit. With `policy`, the model is checked as if it ran
    under it (its layers moved as `precision_audit(policy=)` moves them)."""
    if policy is None:
        measured = drift.layer_drift(model, sample)
    else:
        target = policy_lib.get(policy)
        with _Moved(planning.plan(model, policy=target), target):
            measured = drift.layer_drift(model, sample)
    risks = []
    for d in measured.beyond_rounding():
        dtype = measured.dtype_of(d)
        if d.rounded_by:
            cause = (
                f"it takes {dtype} results of {', '.join(map(repr, d.rounded_by))}, "
                "and cancels what they lost"
            )
        elif d.rounded_at_boundary:
            cause = (
                f"Keras rounds its float32 inputs to {dtype} before its call "
                "runs, and they carry more digits than 16 bits hold"
            )
        else:
            cause = f"its own code cancels in {dtype} (subtracts near-equal values)"
        paths = d.fix_paths
        rules = ", ".join(f"kmp.set_layer_policy('name:{p}', 'float32')" for p in paths)
        which = "them" if len(paths) > 1 else "it"
        fix = f"compute {which} in float32: {rules}, then kmp.prepare(model)"
        if d.rounded_at_boundary and not d.rounded_by:
            fix += " (a float32 scope inside its call comes too late)"
        elif not d.rounded_by and not d.keras_class:
            fix = (
                "compute the sensitive part of its call in float32: move it into a "
                "function decorated with @kmp.float32_scope; or " + fix
            )
        risks.append(
            Risk(
                d.path,
                d.class_name,
                f"{dtype} precision",
                f"on the sample its results differ from float32's by "
                f"{d.error:.1%}, its inputs' by {d.input_error:.1%} ({dtype} "
                f"rounds by {drift.EPSILON[dtype] / 2:.2%}): {cause}",
                fix,
            )
        )
    return risks, measured.error


def range_check(
    model: keras.layers.Layer, sample: Any, headroom: float = DEFAULT_HEADROOM
) -> tuple[list[Risk], str]:
    """The layers whose activations on `sample` reach float16's limit (or
    `FLOAT16_MAX / headroom`), as risks, and why the pass could not run
    (or `''`). Where the model computes in float16, only the ops that do are
    counted: those it computes in float32 or bfloat16 cannot overflow
    float16. A model that computes in bfloat16 has nothing to overflow
    (bfloat16 has float32's range). A model that computes all in float32
    has every op counted (what float16 would meet)."""
    dtypes = {
        str(layer.compute_dtype)
        for layer in [model] + [site.layer for site in traversal.walk(model)]
    }
    if "float16" not in dtypes and "bfloat16" in dtypes:
        return [], ""
    measured = ranges.activation_ranges(model, sample, float16_only="float16" in dtypes)
    counted_all = ""
    if measured.counted_all:
        counted_all = (
            "; every op counted, those it computes in float32 too: under its "
            f"own policies it could not be traced ({measured.counted_all})"
        )
    risks = []
    named = measured.above(FLOAT16_MAX / headroom)
    imprecise = _imprecise_in_bfloat16(model, sample) if named else set()
    for r in named:
        over = r.max_abs >= FLOAT16_MAX
        fix = (
            f"compute this layer in float32: kmp.set_layer_policy('name:{r.path}', "
            "'float32'), then kmp.prepare(model)"
        )
        if r.path in imprecise:
            fix += " (bfloat16 has the range but loses this layer's precision)"
        else:
            fix = f"train in bfloat16 ('mixed_bfloat16': float32's range), or {fix}"
        if not over:
            fix = "none needed yet; if training overflows here: " + fix
        risks.append(
            Risk(
                r.path,
                r.class_name,
                "float16 overflow" if over else "near float16's range",
                f"its {r.op} reached |x| = {r.max_abs:.3g} on the sample "
                f"(float16's largest value is {FLOAT16_MAX:g}){counted_all}",
                fix,
            )
        )
    return risks, measured.error


def _imprecise_in_bfloat16(model: keras.layers.Layer, sample: Any) -> set[str]:
    """The layers whose results on `sample` would move far beyond bfloat16's
    rounding with the model under 'mixed_bfloat16' (its layers moved as
    `precision_audit(policy=)` moves them): there bfloat16 is no fix."""
    risks, _ = precision_check(model, sample, "mixed_bfloat16")
    return {r.layer for r in risks}


def _trace(model) -> tuple[tracing.Trace, str, str]:
    """(the trace, why it failed or '', what to do). A model that has no
    `call` of its own (only a `train_step`) is traced through the models it
    holds, each on its own, their layers under their paths in `model`."""
    if planning.has_no_call(model):
        held = {
            name: value
            for name, value in vars(model).items()
            if isinstance(value, keras.Model) and not name.startswith("_")
        }
        layers: dict[str, tracing.LayerOps] = {}
        failed = []
        for name, inner in held.items():
            traced = tracing.trace(inner)
            if traced.error:
                failed.append(f"{name}: {traced.error}")
            for path, ops in traced.layers.items():
                full = f"{inner.name}/{path}"
                layers[full] = dataclasses.replace(ops, path=full)
        cls = type(model).__name__
        error = f"{cls} has no call of its own; " + (
            f"kmp traced the models it holds ({', '.join(held)})"
            if held
            else "it holds no model kmp could trace"
        )
        fix = f"Could not trace {'; '.join(failed)}." if failed else ""
        # Only the parts are traced: the audit says so unless all traced.
        return tracing.Trace(layers), "" if held and not failed else error, fix
    traced = tracing.trace(model)
    fix = ""
    if traced.error and not tracing.traceable(model):
        fix = (
            "Build it first (call it on a batch, or audit it after fit has "
            "built it), then audit it again."
        )
    return traced, traced.error or "", fix


def _mixed_dtype_risks(model, traced: tracing.Trace) -> list[Risk]:
    """A trace that failed on mixed float dtypes in user code (a float32
    tensor made without a dtype, meeting a 16-bit one): the line, and the
    fix."""
    error = traced.error or ""
    if not traced.error_at or not tracing.mixes_dtypes(error):
        return []
    where, _, code = traced.error_at.partition(": ")
    where, _, owner = where.partition(" in ")
    return [
        Risk(
            where,
            owner.split(".")[0] or type(model).__name__,
            "dtype error",
            f"`{code}` mixes float dtypes under this policy ({error})",
            "make the float32 operand in the compute dtype where it is created: "
            "dtype=x.dtype (keras.random.normal(shape, dtype=x.dtype), "
            "keras.ops.ones(shape, dtype=x.dtype)), or keras.ops.cast(t, x.dtype)",
        )
    ]


class _Moved:
    """Moves the layers that follow the model's policy to `target` (as if
    the model had been built under it, before `kmp.prepare`), and restores
    their policies on exit."""

    def __init__(self, the_plan: planning.Plan, target: policy_lib.Policy | None):
        self._plan = the_plan
        self._target = target
        self._saved: list[tuple[keras.layers.Layer, Any]] = []

    def __enter__(self):
        if self._target is None:
            return self
        for d in self._plan:
            if d.policy is None or d.explicit:
                continue
            if quantization.float_part(d.layer) != self._target.keras_name:
                self._saved.append((d.layer, quantization.snapshot(d.layer)))
                refused = quantization.refusal(
                    quantization.mode(d.layer), self._target.compute_dtype
                )
                target = d.policy if refused else self._target
                quantization.set_float_part(d.layer, target.keras_name)
        return self

    def __exit__(self, *exc):
        for layer, saved in reversed(self._saved):
            quantization.restore(layer, saved)


# --- fixes ----------------------------------------------------------------------


def _in_code_fix(kind_name: str, cls: str, owner: str) -> str:
    """The line to write in `owner.call` for a sensitive layer that kmp must
    leave 16-bit there."""
    fix = (
        f"create it as {cls}(..., dtype='float32') and, in {owner}, cast "
        "what it returns back: keras.ops.cast(y, x.dtype)"
    )
    if kind_name == "convolution":
        return f"none needed for correctness; for speed, {fix}, or use mixed_bfloat16"
    return fix


_OWN_SOFTMAX_FIX = (
    "in {owner}, compute it in float32: move it into a function decorated "
    "with @kmp.float32_scope (it casts the inputs to float32 and the result "
    "back)"
)
_OWN_SCORES_FIX = (
    "in {owner}, compute the product of query and key and the softmax in a "
    "function decorated with @kmp.float32_scope (it casts the inputs to "
    "float32 and the result back)"
)
_PREPARE_FIX = (
    "kmp.prepare(model) (or kmp.compile): it keeps what the layer returns to your code"
)


def _rounded(value: int, dtype: str) -> int:
    rounded = keras.ops.cast(keras.ops.cast(float(value), dtype), "float32")
    return int(float(rounded))


# --- per-layer risks ------------------------------------------------------------


def _layer_risks(d: planning.Decision, ops) -> list[Risk]:
    """The risks of one layer: its decision in the plan against the state it
    is in now (the trace was taken in that state)."""
    if d.policy is None:
        return []
    layer, path = d.layer, d.path
    cls = type(layer).__name__
    kind = d.kind[0] if d.kind else None
    mode = quantization.mode(layer)
    if mode and quantization.refusal(mode, "float16") and d.rule.startswith(mode):
        return [
            Risk(
                path,
                cls,
                f"{mode} kept out of float16",
                f"{d.note.split(';')[0]}; kmp computes it in {d.policy.compute_dtype}",
                "use mixed_bfloat16 for this model, or quantize the float model "
                "to int4 or float8 instead (model.quantize('int4') before "
                "quantizing to int8)",
            )
        ]
    current = layer.compute_dtype
    if current not in _SIXTEEN:
        return []
    risks = []
    applied = applied_lib.applied(layer) is not None
    inside_attention = planning.is_keras_attention(d.site.parent)
    # What prepare would change and has not yet.
    if (
        d.policy.compute_dtype == "float32"
        and d.rule.startswith("default:")
        and d.rule != planning.TOKEN_IDS  # named by the token-ids check
        and not inside_attention  # named once, at the attention layer
        and not applied
    ):
        if d.rule in planning.FLOAT32_OUTPUTS:
            what = "output"
        elif d.rule == planning.ATTENTION_SCORES:
            what = "attention scores"
        else:
            what = kind.name if kind else "layer"
        risks.append(
            Risk(
                path,
                cls,
                f"16-bit {what}",
                f"computes in {current}; kmp's rule: {d.rule}",
                _PREPARE_FIX,
            )
        )
    # What kmp leaves 16-bit because user code consumes it.
    if d.note.startswith("left") and kind is not None:
        owner = traversal.code_of(d.site.user_code)
        slow = kind.action == kinds.CPU_FLOAT16
        risks.append(
            Risk(
                path,
                cls,
                "slow on this machine" if slow else f"16-bit {kind.name}",
                f"computes in {current}: {d.note.split(': ', 1)[1]}, so kmp "
                "leaves it (its output dtype must not change)",
                _in_code_fix(kind.name, cls, owner),
            )
        )
    if d.note.startswith("a model output"):
        risks.append(
            Risk(
                path,
                cls,
                "16-bit output",
                f"computes in {current}: {d.note}",
                "add keras.layers.Activation('linear', dtype='float32') after "
                f"it, or kmp.set_layer_policy('name:{path}', 'float32') to "
                "compute it all in float32",
            )
        )
    # What the layer's own code computes in 16-bit, as traced: only where no
    # kmp rule covers it (a layer kmp does not know, or one it leaves).
    own_code = kind is None or kind.action == kinds.KEEP
    keras_scores = kind is not None and kind.action == kinds.SCORES
    if ops is not None and (own_code or keras_scores):
        softmax = [t for t in ops.softmax if t in _SIXTEEN]
        if softmax and own_code:
            risks.append(
                Risk(
                    path,
                    cls,
                    "16-bit softmax",
                    f"its call computes a softmax in {softmax[0]}",
                    _OWN_SOFTMAX_FIX.format(owner=f"{cls}.call"),
                )
            )
        scores = [t for t in ops.scores if t in _SIXTEEN]
        if scores and d.rule != planning.ATTENTION_SCORES:
            risks.append(_scores_risk(d, scores[0]))
    if not type(layer).__module__.startswith("keras"):
        error = _dtype_error(layer)
        if error:
            risks.append(
                Risk(
                    path,
                    cls,
                    "dtype error",
                    error,
                    "cast constants to the input's dtype: "
                    "keras.ops.cast(c, x.dtype), or use self.compute_dtype",
                )
            )
    for what, size in _matmul_dims(layer):
        if size >= 8 and size % 8:
            padded = -(-size // 8) * 8
            risks.append(
                Risk(
                    path,
                    cls,
                    "size not a multiple of 8",
                    f"{what} = {size}",
                    f"use {padded} for Tensor Core speed on GPUs",
                )
            )
    return risks


def _scores_risk(d: planning.Decision, dtype: str) -> Risk:
    layer = d.layer
    cls = type(layer).__name__
    kind = d.kind[0] if d.kind else None
    if kind is not None and kind.action == kinds.SCORES:
        mode = attention.attention_scores()
        why = (
            f"kmp's default under {dtype}: Keras's own attention"
            if mode == "auto"
            else f"kmp.rules.set_attention_scores({mode!r})"
        )
        return Risk(
            d.path,
            cls,
            "16-bit attention scores",
            f"query x key in {dtype} ({why}); the error grows with the logits "
            "(about 5% at inputs of scale 10 under bfloat16)",
            "kmp.rules.set_attention_scores('float32') computes query/key, "
            "scores and softmax in float32 (slower)",
        )
    overflow = (
        "float16 logits overflow above 65504 (inf, then NaN)"
        if dtype == "float16"
        else "bfloat16 logits lose precision as they grow"
    )
    source = f" ({d.kind[1]}'s own code)" if d.kind and d.kind[1] != "Keras" else ""
    return Risk(
        d.path,
        cls,
        "16-bit attention scores",
        f"its call multiplies query by key in {dtype}{source}: {overflow}",
        _OWN_SCORES_FIX.format(owner=f"{cls}.call"),
    )


def _dtype_error(layer) -> str | None:
    """Calls a user-written layer on zeros under its current policy; returns
    the dtype error it raises, if any."""
    spec = tracing.recorded_input(layer)
    if spec is None:
        return None
    shape = [2 if d is None else d for d in spec.shape]
    try:
        dtype = spec.dtype
        if keras.backend.is_float_dtype(dtype):
            dtype = layer.compute_dtype
        layer(keras.ops.zeros(shape, dtype=dtype))
    except (*tracing.dtype_errors(), ValueError) as e:
        return tracing.error_line(e)[:160]
    return None


def _matmul_dims(layer) -> list[tuple[str, int]]:
    dims = []
    if isinstance(layer, keras.layers.Dense):
        dims.append(("units", layer.units))
        if layer.built:
            dims.append(("input features", int(layer.kernel.shape[0])))
    elif isinstance(layer, keras.layers.Embedding):
        dims.append(("output_dim", layer.output_dim))
    elif hasattr(layer, "filters") and hasattr(layer, "kernel_size"):
        dims.append(("filters", layer.filters))
        if layer.built and getattr(layer, "kernel", None) is not None:
            dims.append(("input channels", int(layer.kernel.shape[-2])))
    return dims


# --- model-level risks ----------------------------------------------------------


def _token_id_risks(model, the_plan: planning.Plan) -> list[Risk]:
    """A float keras.Input whose values reach an Embedding after a layer cast
    them to the 16-bit compute dtype: token ids get rounded."""
    risks = []
    sites = {id(d.layer): d.site for d in the_plan}

    def risk(where, embedding, through):
        dtype = through.compute_dtype
        top = embedding.input_dim - 1
        lost = {"bfloat16": 256, "float16": 2048}[dtype]
        if top <= lost:
            return
        rounded = _rounded(top, dtype)
        consequence = (
            "silently"
            if rounded < embedding.input_dim
            else "and the lookup is out of range"
        )
        risks.append(
            Risk(
                where,
                type(through).__name__,
                "float token ids",
                f"a float keras.Input carries token ids to an Embedding (input_dim "
                f"{embedding.input_dim}) through {type(through).__name__}, which "
                f"casts them to {dtype}: ids above {lost} are rounded ({top} "
                f"becomes {rounded}), {consequence}",
                "declare the ids as integers: keras.Input(shape, dtype='int32'); "
                "kmp.prepare keeps them exact where the layer's output allows",
            )
        )

    for _, reached in traversal.float_input_paths(model):
        previous = None
        for layer, rounded_before in reached:
            site = sites.get(id(layer))
            if isinstance(layer, keras.layers.Embedding) and rounded_before:
                risk(site.path if site else layer.name, layer, previous or layer)
            elif (
                not rounded_before
                and token_ids.rounds_token_ids(layer)
                and layer.compute_dtype in _SIXTEEN
            ):
                inner = [
                    s
                    for s in keras_private.sublayers(layer)
                    if isinstance(s, keras.layers.Embedding)
                ]
                risk(site.path if site else layer.name, max(inner, key=_dim), layer)
            if layer.compute_dtype in _SIXTEEN:
                previous = layer
    return risks


def _dim(embedding) -> int:
    return embedding.input_dim


def _output_risks(model, traced: tracing.Trace) -> list[Risk]:
    """A model with its own training code whose traced outputs are 16-bit
    where no layer-level risk explains it (a subclassed model, an output
    produced by ops): that code receives them so."""
    sixteen = [d for d in traced.outputs if d in _SIXTEEN]
    if not sixteen:
        return []
    if traversal.is_graph(model):
        detail = (
            f"the model returns {sixteen[0]}: an output is produced by code kmp "
            "cannot change (an op after a 16-bit layer, or a layer's own code)"
        )
    else:
        detail = (
            f"the model returns {sixteen[0]}: a subclassed model returns what "
            "its call returns, and kmp cannot see which layer produces it"
        )
    return [
        Risk(
            model.name,
            type(model).__name__,
            "16-bit output",
            detail,
            "return keras.ops.cast(y, 'float32') (or end in "
            "keras.layers.Activation('linear', dtype='float32'))",
        )
    ]
