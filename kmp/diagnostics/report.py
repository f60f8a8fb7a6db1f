"""`kmp.precision_report`: per layer, what it computes in, what it returns,
what computes in float32 inside it, and the rule that decided it."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Iterator

import keras

from kmp._base.table import format_table
from kmp.backend import grappler
from kmp.backend import tracing
from kmp.backend import underflow as underflow_lib
from kmp.diagnostics import compiled_by
from kmp.diagnostics import doctor
from kmp.diagnostics import underflow
from kmp.internals import keras_private
from kmp.layers import attention as attention_layers
from kmp.layers import batch_normalization
from kmp.layers import layer_normalization
from kmp.planning import applied as applied_lib
from kmp.planning import decisions as planning
from kmp.precision import kinds
from kmp.precision import policy as policy_lib
from kmp.precision import quantization
from kmp.precision import traversal
from kmp.training import compile as model_lib


@dataclasses.dataclass(frozen=True)
class LayerPrecision:
    """One row of a precision report.

    Attributes:
        path: The layer's path in the model.
        class_name: Its class.
        compute_dtype: The dtype its call computes in (its policy's: what
            Keras casts its inputs and variables to); `''` for a layer that
            is not a float layer.
        variable_dtype: The dtype of its variables.
        rule: What decided its policy.
        returns: The dtype(s) it returns, as traced (`''` when not traced).
        inside: What computes in float32 inside it, as the defaults know it
            (`'float32 inside (Keras)'`) or as traced
            (`'float32 inside: Mean, Rsqrt'`); `''` when nothing does.
        kind: Its kind (`'normalization'`, `'attention'`, ...), if known.
        note: Why a default did not apply to it, if one did not.
        quantization: Its quantization mode (`'int8'`, `'int4'`, `'float8'`,
            ...), `''` when not quantized; `compute_dtype` is then the float
            policy it computes in around its quantized weights.
        lora_rank: Its LoRA rank (`layer.enable_lora`), 0 without LoRA.
        trains: Which of its own weights train (`'yes'`, `'no'`,
            `'adapters'`: only its LoRA weights, `'partly'`); `''` for a
            layer with no float weights of its own.
        gradient_underflow: The fraction of its own weights' gradient values
            that its 16-bit dtype flushes to zero at the loss scale, where
            measured (`precision_report(model, sample=...)`), else None.
    """

    path: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    rule: str
    returns: str = ""
    inside: str = ""
    kind: str = ""
    note: str = ""
    quantization: str = ""
    lora_rank: int = 0
    trains: str = ""
    gradient_underflow: float | None = None


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """The precision of every layer of a model.

    `str(report)` is a table; `report.rows` is the data.

    Attributes:
        model_name: The model's name.
        policy: The model's policy.
        rows: One `LayerPrecision` per layer.
        outputs: The dtypes of the model's outputs, as traced.
        not_traced: Why the model was not traced, or `''` when it was.
        loss_scaling: How the model's optimizers scale the loss, and why
            (`kmp.compile` decides it from the model's own layers).
        remapper: Where it matters to this model (a machine without GPUs,
            and float16 in the model or kmp's float16 setting in force):
            grappler's remapping setting now, which is process-wide, and how
            to keep it right for this model (`remapper_note`); `''`
            elsewhere.
        policy_lost: Where the policy `kmp.set_policy` set is no longer in
            force and the model computes in another, that sentence with the
            fix (`kmp.precision.policy.lost_policy`); `''` elsewhere.
        underflow: The gradient underflow measured on the sample
            (`kmp.debug.gradient_underflow`), or None.
        memory: Where the model's Keras normalization layers keep a
            float32 copy of their 16-bit input for the backward pass, that
            sentence with what keeps the 16-bit input instead
            (`kmp.layers`); where its Keras `MultiHeadAttention` (or
            `GroupQueryAttention`) layers keep a float32 copy of their 16-bit
            attention probabilities beside them, that sentence with what
            keeps the 16-bit ones alone; where kmp's speed rule computes
            convolutions in float32 under float16 on a machine without GPUs,
            what that costs and the switch that trades it back
            (`kmp.rules.set_cpu_convolutions`); where its output is a float32
            softmax layer of its own on the 16-bit logits of a layer with
            fewer inputs than classes, which the step then keeps beside their
            float32 copy, that sentence with what keeps only the float32
            ones; `''` elsewhere.
    """

    model_name: str
    policy: str
    rows: tuple[LayerPrecision, ...]
    outputs: tuple[str, ...] = ()
    not_traced: str = ""
    loss_scaling: str = ""
    remapper: str = ""
    policy_lost: str = ""
    underflow: underflow_lib.Underflow | None = None
    memory: str = ""

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
        header = ["layer", "class", "computes", "returns", "inside", "decided by"]
        cells = [
            [r.path, r.class_name, r.compute_dtype, r.returns, r.inside, r.rule]
            for r in self.rows
        ]
        # Quantization, LoRA and frozen weights: shown where a model has them.
        if any(
            r.quantization or r.lora_rank or r.trains in ("no", "partly", "adapters")
            for r in self.rows
        ):
            header[3:3] = ["quantized", "LoRA", "trains"]
            for r, row in zip(self.rows, cells, strict=True):
                row[3:3] = [r.quantization, str(r.lora_rank or ""), r.trains]
        if self.underflow is not None and not self.underflow.error:
            header.append(f"underflow at {self.underflow.scale:g}")
            for r, row in zip(self.rows, cells, strict=True):
                measured = r.gradient_underflow
                row.append("" if measured is None else f"{measured:.1%}")
        table = format_table(tuple(header), [tuple(row) for row in cells])
        lines = [
            f"Precision of {self.model_name!r} (model policy: {self.policy})",
            table,
        ]
        if self.policy_lost:
            lines.append(
                textwrap.fill(self.policy_lost, width=88, break_on_hyphens=False)
            )
        if self.outputs:
            lines.append(f"Outputs: {', '.join(self.outputs)}")
        if self.loss_scaling:
            lines.append(f"Loss scaling: {self.loss_scaling}")
        if self.memory:
            lines.append(textwrap.fill(self.memory, width=88, break_on_hyphens=False))
        if self.not_traced:
            lines.append(f"Not traced: {self.not_traced}.")
        if self.remapper:
            lines.append(textwrap.fill(self.remapper, width=88, break_on_hyphens=False))
        if self.underflow is not None:
            lines.append(_underflow_lines(self.underflow))
        return "\n".join(lines)


def remapper_note(
    setting: grappler.RemapperSetting,
    float16: bool | None = None,
    policy: str = "",
) -> str:
    """In words: grappler's remapping setting now, that it is process-wide,
    and how to keep it right, where that matters; `''` where it does not.

    For a model (`float16`: whether it computes in float16; `policy`: its
    policy's name) it matters on a machine where kmp switches the setting
    (no GPUs): for a float16 model always, for another model while kmp has
    it off. Without a model (`float16=None`, `kmp doctor`) it matters on
    every such machine.

    Example:

    >>> setting = kmp.backend.grappler.RemapperSetting(
    ...     enabled=True, managed=True, set_by_kmp=False, decided_by="float32")
    >>> print(kmp.diagnostics.report.remapper_note(setting, float16=True,
    ...                                policy="mixed_float16"))
    Grappler remapping: ON now, for every model in this process: ...
    >>> kmp.diagnostics.report.remapper_note(setting, float16=False, policy="float32")
    ''
    """
    if not setting.managed:
        return ""
    if float16 is None:
        return doctor.machine_remapper_note(setting)
    if not float16 and not setting.set_by_kmp:
        return ""  # kmp leaves it alone for this model, and so did the others
    wanted = policy if _computes_in_float16(policy) == float16 else ""
    wanted = wanted or ("mixed_float16" if float16 else "float32")
    fix = (
        "Fix: train models of different policies in separate processes, or "
        f"call kmp.set_policy({wanted!r}) (or kmp.compile this model again) "
        "right before each fit of this model."
    )
    if float16 and not setting.enabled:
        why = (
            "kmp turns it off while float16 is in force on a machine without "
            "GPUs: its fused float16 MatMul+BiasAdd CPU kernel is very slow"
            if setting.set_by_kmp
            else "set outside kmp, with tf.config.optimizer.set_experimental_options"
        )
        head = f"Grappler remapping: off now, for every model in this process ({why})."
    elif float16:
        by = f" (for {setting.decided_by})" if setting.decided_by else ""
        head = (
            "Grappler remapping: ON now, for every model in this process: the "
            f"last kmp.set_policy or kmp.compile{by}, or "
            "tf.config.optimizer.set_experimental_options, left it on, so this "
            "float16 model's fit runs the fused float16 MatMul+BiasAdd CPU "
            "kernel, measured ~50x slower than float32 on Intel CPUs."
        )
    else:
        head = (
            "Grappler remapping: off now, for every model in this process: kmp "
            "turned it off for the float16 policy or model set up last, so this "
            "model, which does not compute in float16, also trains without "
            "grappler's fused kernels."
        )
    return f"{head} {grappler.REMAPPER_PROCESS_WIDE} {fix}"


def _computes_in_float16(policy: str) -> bool:
    try:
        return policy_lib.get(policy).compute_dtype == "float16"
    except (ValueError, TypeError):
        return False


def _variable_dtype(layer: keras.layers.Layer) -> str:
    own = {v.dtype for v in layer.weights} if not traversal.children(layer) else set()
    floats = {d for d in own if keras.backend.is_float_dtype(d)}
    if len(floats) == 1:
        return keras.backend.standardize_dtype(floats.pop())
    return layer.variable_dtype or ""


def _inside(decision, ops) -> str:
    if decision.layer.compute_dtype not in policy_lib.SIXTEEN_BIT:
        return ""
    kind = decision.kind
    if kind is not None and kind[0].inside:
        return f"{kind[0].inside} ({kind[1]})"
    if ops is not None and ops.float32_ops:
        return (
            "float32 inside: "
            + ", ".join(ops.float32_ops[:4])
            + (", ..." if len(ops.float32_ops) > 4 else "")
        )
    return ""


def _underflow_lines(measured: underflow_lib.Underflow) -> str:
    if measured.error:
        return f"Gradient underflow not measured: {measured.error}."
    text = (
        f"Underflow: the fraction of each 16-bit layer's gradient values that "
        f"flush to zero at loss scale {measured.scale:g} (one float32 pass on "
        "the sample)."
    )
    advice = measured.advice()
    if advice:
        text += " " + advice
    return textwrap.fill(text, width=88, break_on_hyphens=False)


def precision_report(
    model: keras.layers.Layer,
    *,
    trace: bool = True,
    sample: tuple | None = None,
) -> PrecisionReport:
    """Reports, per layer, the dtype its call computes in, the dtype it
    returns, whether something inside it computes in float32, and the rule
    that decided its policy.

    The report shows the model as it is: run `kmp.prepare` (or `kmp.compile`)
    first to see kmp's rules applied. What a layer returns and computes
    inside is read from one traced forward pass (nothing runs) for built
    models; pass `trace=False` to skip it.

    With `sample=(x, y)` (or `(x, y, sample_weight)`) and a compiled model,
    it also measures, per layer computing in 16-bit, the fraction of its
    gradient values float16 flushes to zero at the optimizer's current loss
    scale (`kmp.debug.gradient_underflow`: one float32 forward and backward
    pass on the batch; nothing of the model changes), and says what helps
    the layer that loses the most.

    Args:
        model: A Keras model or layer.
        trace: Trace the forward pass to fill `returns` and `inside`.
        sample: A batch `(x, y)` or `(x, y, sample_weight)` to measure
            gradient underflow on, or None.

    Returns:
        A `PrecisionReport`: `print()` it for a table, or read `.rows`.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = kmp.prepare(keras.Sequential(
    ...     [keras.Input((8,)), keras.layers.Dense(8, name="dense"),
    ...      keras.layers.LayerNormalization(name="norm"),
    ...      keras.layers.Dense(4, name="head")], name="tiny"))
    >>> report = kmp.precision_report(model)
    >>> print(report)  # doctest: +ELLIPSIS
    Precision of 'tiny' (model policy: mixed_bfloat16)
    layer  class  ...
    >>> [(r.path, r.compute_dtype, r.returns) for r in report]
    [('dense', 'bfloat16', 'bfloat16'), ('norm', 'bfloat16', 'bfloat16'),
     ('head', 'bfloat16', 'bfloat16')]
    >>> report.row("norm").inside, report.row("head").rule
    ('float32 inside (Keras)', 'default: model output cast to float32')
    >>> report.outputs
    ('bfloat16',)

    See also: `kmp.prepare`, `kmp.debug.precision_audit`.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "precision_report() expects a Keras model or layer. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    if sample is not None and not (isinstance(sample, tuple) and len(sample) in (2, 3)):
        raise ValueError(
            "precision_report(sample=...) is a batch to measure gradient "
            "underflow on: a tuple (x, y) or (x, y, sample_weight). Received: "
            f"{type(sample).__name__}."
        )
    compiled_by.note_compiled_without_kmp(model, "kmp.precision_report")
    measured = (
        underflow.gradient_underflow(model, *sample) if sample is not None else None
    )
    fractions = (
        {r.path: r.flushed_fraction for r in measured.layers} if measured else {}
    )
    the_plan = planning.plan(model)
    traced = tracing.trace(model) if trace else None
    rows = []
    for d in the_plan:
        layer = d.layer
        record = applied_lib.applied(layer)
        heal = applied_lib.healed.get(layer)
        if heal is not None and quantization.float_part(layer) == heal.float_part:
            rule = heal.text
        elif record is not None:
            rule = record.rule
        elif d.explicit:
            rule = planning.EXPLICIT
        elif d.policy is None or (
            d.policy.keras_name == quantization.float_part(layer)
            and d.rule
            in (
                planning.POLICY,
                planning.INHERITED,
            )
        ):
            rule = d.rule
        else:
            rule = f"{planning.POLICY} (kmp.prepare not applied)"
        ops = traced.of(d.path) if traced is not None else None
        float_layer = planning.is_float_layer(layer)
        rows.append(
            LayerPrecision(
                d.path,
                type(layer).__name__,
                layer.compute_dtype if float_layer else "",
                _variable_dtype(layer) if float_layer else "",
                rule,
                returns=", ".join(ops.returns) if ops is not None else "",
                inside=_inside(d, ops) if float_layer else "",
                kind=d.kind[0].name if d.kind else "",
                note=d.note,
                quantization=quantization.mode(layer) or "",
                lora_rank=quantization.lora_rank(layer),
                trains=quantization.trains(layer),
                gradient_underflow=fractions.get(d.path),
            )
        )
    return PrecisionReport(
        model.name,
        the_plan.base.name,
        tuple(rows),
        outputs=traced.outputs if traced is not None else (),
        not_traced=(traced.error or "") if traced is not None else "",
        loss_scaling=(
            model_lib.describe_loss_scaling(model)
            if isinstance(model, keras.Model) and model.compiled
            else ""
        ),
        remapper=remapper_note(
            grappler.remapper_setting(),
            the_plan.computes_in_float16,
            the_plan.base.name,
        ),
        policy_lost=policy_lib.lost_policy(the_plan.base.keras_name),
        underflow=measured,
        memory=(
            ""
            if getattr(model, "jit_compile", False) is True  # XLA decides
            else " ".join(
                note
                for note in (
                    _memory_note(the_plan),
                    _attention_note(the_plan),
                    _cpu_convolutions_note(the_plan),
                    _output_copy_note(model),
                )
                if note
            )
        ),
    )


def _output_copy_note(model) -> str:
    """Where the model's output is a softmax layer of its own that computes
    in float32 on the 16-bit logits of a layer with a linear activation
    argument (Keras's mixed-precision guide writes `Activation('softmax',
    dtype='float32')` after the last Dense), and that layer has fewer inputs
    than classes: the step keeps the 16-bit logits beside their float32
    copy, and folding the softmax into that layer (computed in float32 as
    a softmax, it keeps a float32 copy of its inputs instead) keeps less.
    `''` elsewhere, and for a head with as many inputs as classes or more,
    where the fold would cost more than it saves. Read from the model's
    graph (a Sequential or Functional model's own outputs; the first such
    output only)."""
    if not isinstance(model, keras.Model):
        return ""
    try:
        outputs = {id(t) for t in keras.tree.flatten(model.outputs)}
    except (AttributeError, ValueError):  # a subclassed model has none
        return ""
    for layer in model.layers:
        name = (
            "softmax"
            if isinstance(layer, keras.layers.Softmax)
            else kinds.activation_name(layer)
            if isinstance(layer, keras.layers.Activation)
            else None
        )
        spec = tracing.recorded_input(layer)
        if name is None or spec is None or layer.compute_dtype != "float32":
            continue
        try:
            if id(layer.output) not in outputs:
                continue
        except (AttributeError, ValueError):
            continue
        head = keras_private.producer(spec)
        head_input = tracing.recorded_input(head)
        classes = spec.shape[-1]
        if not (
            isinstance(head, keras.layers.Layer)
            # An activation argument, left linear: there to fold into.
            and getattr(getattr(head, "activation", None), "__name__", "") == "linear"
            and head_input is not None
            # What it computes in now (kmp.prepare, a layer rule), not the
            # dtype recorded when the model was built.
            and head.compute_dtype in policy_lib.SIXTEEN_BIT
            and classes is not None
            and head_input.shape[-1] is not None
            and classes > head_input.shape[-1]
        ):
            continue
        return (
            f"Memory: the output {layer.name!r} computes a float32 {name} of "
            f"{head.name!r}'s 16-bit logits, so the step keeps them beside "
            f"their float32 copy ({classes:,} 16-bit values per output "
            f"position, {2 * classes:,} bytes). Folding it into {head.name!r} "
            f"(activation={name!r}), which kmp then computes in float32, or "
            f"outputting {head.name!r}'s logits with "
            f"kmp.set_layer_policy('name:{head.name}', 'float32') and the "
            "loss compiled with from_logits=True, keeps only the float32 "
            f"ones, for a float32 matmul in {head.name!r} and a float32 copy "
            f"of its {head_input.shape[-1]:,} inputs per position (fewer than "
            "its classes)."
        )
    return ""


def _memory_note(decisions) -> str:
    """What the model's normalizations keep for the backward pass, where
    kmp's layer would keep less; `''` elsewhere."""
    copies = [
        d.path
        for d in decisions
        if batch_normalization.keeps_float32_copy(d.layer)
        or layer_normalization.keeps_float32_copy(d.layer)
    ]
    if not copies:
        return ""
    return (
        f"Memory: {_layers_that(copies, 'normalization', 'keep')} a float32 copy "
        "of the 16-bit input for the backward pass, twice "
        "the memory of the input itself. kmp.layers.lean(model) "
        "(before compiling a Keras Sequential or Functional model), or "
        "kmp.layers.BatchNormalization and LayerNormalization in the model's "
        "code, keep the 16-bit input instead."
    )


def _attention_note(the_plan) -> str:
    """What the model's attention layers keep for the backward pass, where
    kmp's layer would keep less; `''` elsewhere. Read with the policies kmp's
    plan gives the projections (under float16 its float32 scores rule moves
    the query and key to float32), prepared or not yet."""
    planned = {id(d.layer): d for d in the_plan}

    def compute_dtype(layer: keras.layers.Layer) -> str:
        d = planned.get(id(layer))
        if d is None or d.explicit or d.policy is None:
            return layer.compute_dtype
        return d.policy.compute_dtype

    copies = [
        d.path
        for d in the_plan
        if attention_layers.keeps_float32_copy(d.layer, compute_dtype)
    ]
    if not copies:
        return ""
    return (
        f"Memory: {_layers_that(copies, 'attention', 'keep')} a float32 copy of "
        "the 16-bit attention probabilities ([batch, heads, queries, keys]) "
        "for the backward pass beside the 16-bit ones, three times the memory "
        "of the 16-bit ones alone. kmp.layers.lean(model) puts "
        "kmp.layers.MultiHeadAttention and GroupQueryAttention, which keep the "
        "16-bit ones alone, in "
        "place of Keras's own in a Sequential or Functional model before it is "
        "compiled; a subclass of Keras's layer, or one a model's own code "
        "creates, takes kmp's there instead (as its base class, or in that "
        "code)."
    )


def _layers_that(paths: list[str], kind: str, verb: str) -> str:
    """`"2 attention layers ('a', 'b') keep"` (`verb` 'keep'), `"1 attention
    layer ('a') keeps"`: the first three named."""
    named = ", ".join(repr(path) for path in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    if len(paths) == 1:
        return f"1 {kind} layer ({named}) {verb}s"
    return f"{len(paths)} {kind} layers ({named}{more}) {verb}"


def _cpu_convolutions_note(decisions) -> str:
    """What kmp's speed rule for float16 on CPUs (convolutions in float32)
    costs in memory; `''` where it moved no layer."""
    moved = [d for d in decisions if d.rule == planning.CPU_CONVOLUTIONS]
    if not moved:
        return ""
    compute = _layers_that([d.path for d in moved], "convolution", "compute")
    per_sample = _input_values(d.layer for d in moved)
    size = (
        f": {per_sample:,} values per sample, {2 * per_sample:,} bytes more "
        "than in float16"
        if per_sample
        else ""
    )
    return (
        f"Memory: {compute} in float32 under float16 on this machine, "
        "which has no GPU (kmp's speed rule: float16 convolutions are slow on "
        "CPUs). Their kernels' gradients read their inputs in float32, kept "
        f"from the forward pass{size} (and an activation's output where one "
        "needs it). kmp.rules.set_cpu_convolutions('memory') computes them in "
        "float16, as Keras does, for a much slower step; the 'mixed_bfloat16' "
        "policy computes convolutions in 16 bits on CPUs."
    )


def _input_values(layers) -> int:
    """The values per sample the layers' inputs hold, over every call of
    each in a functional graph; 0 where a layer has no recorded call or an
    input's shape is not known."""
    total = 0
    for layer in layers:
        nodes = keras_private.inbound_nodes(layer)
        if not nodes:
            return 0
        for node in nodes:
            for tensor in node.input_tensors:
                shape = tensor.shape[1:]
                if any(size is None for size in shape):
                    return 0
                total += math.prod(shape)
    return total
