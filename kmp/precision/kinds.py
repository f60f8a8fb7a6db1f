"""Layer kinds: what a layer class computes in, and what kmp does with it.

`DEFAULTS` is kmp's table of the layer classes it knows (Keras's and
KerasHub's), as data: each row names a class and its `LayerKind`, whose
`action` says what kmp does under a 16-bit policy and whose `why` says why.
Libraries and users add their own classes with `register_layer_class`
(also reachable as `kmp.rules.register_layer_class`). `kmp.planning` reads
the kinds to decide each layer's policy; `kmp.diagnostics.report` and `kmp.debug` read
them to describe layers.
"""

from __future__ import annotations

import dataclasses
import threading

import keras

from kmp._base import warn as _warn
from kmp.internals import keras_hub_names as hub
from kmp.internals import keras_private


def qualified_name(cls: type) -> str:
    """`'module.QualName'` of a class, the key kinds are registered under."""
    return f"{cls.__module__}.{cls.__qualname__}"


KEEP = "keep"  # kmp leaves the layer's policy alone
ISLAND = "float32 where its consumers cast"  # a float32 island, interface-safe
SCORES = "attention scores rule"  # sublayers of Keras's attention
CPU_FLOAT16 = "float32 under float16 on CPUs"  # the speed rule


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """A kind of layer: what its call computes in, and what kmp does with it.

    Attributes:
        name: Short name for reports (`'normalization'`, `'softmax'`, ...).
        action: What kmp does under a 16-bit policy: `KEEP` (leave it),
            `ISLAND` (compute it in float32 where everything consuming its
            output casts or promotes; elsewhere leave it and let the audit
            name it), `SCORES` (Keras's attention: see
            `set_attention_scores`) or `CPU_FLOAT16` (float32 under float16
            on machines with no GPU or TPU, as an island).
        inside: What the layer's own code computes in float32 on 16-bit
            inputs, if anything (`'float32 inside'`), else `''`.
        why: The reason, for reports.
    """

    name: str
    action: str
    inside: str
    why: str


NORMALIZATION_FLOAT32_INSIDE = LayerKind(
    "normalization",
    KEEP,
    "float32 inside",
    "computes mean and variance in float32 on 16-bit inputs and returns the "
    "compute dtype: nothing to change",
)
NORMALIZATION_16BIT = LayerKind(
    "normalization",
    ISLAND,
    "",
    "computes its reductions in the compute dtype: float16 squares overflow "
    "above 256, bfloat16 sums lose precision",
)
SOFTMAX = LayerKind(
    "softmax",
    ISLAND,
    "",
    "a 16-bit softmax loses precision (bfloat16: tens of percent at logits "
    "of 30) and a float16 one overflows unless max-subtracted",
)
ATTENTION_KERAS = LayerKind(
    "attention",
    SCORES,
    "",
    "Keras multiplies query by key in the compute dtype: float16 logits "
    "overflow at large inputs",
)
ATTENTION_16BIT = LayerKind(
    "attention",
    ISLAND,
    "",
    "computes its scores and softmax in the compute dtype",
)
ATTENTION_FLOAT32_SOFTMAX = LayerKind(
    "attention",
    KEEP,
    "float32 softmax inside; query x key in the compute dtype",
    "its own code computes the softmax in float32; kmp cannot change its "
    "query x key product without changing what it returns",
)
ATTENTION_OWN_CODE = LayerKind(
    "attention",
    KEEP,
    "",
    "its own call computes query x key and the softmax in the compute dtype; "
    "kmp cannot change them without changing what it returns",
)
CONVOLUTION = LayerKind(
    "convolution",
    CPU_FLOAT16,
    "",
    "float16 convolutions are slow on CPUs, with and without native float16 "
    "math (speed, not precision)",
)


@dataclasses.dataclass(frozen=True)
class Default:
    """One row of kmp's defaults: a layer class and its kind.

    Attributes:
        layer_class: The class, or its qualified name
            (`'keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm'`),
            so that a library's classes are recognised without importing it.
            Subclasses match too (the most specific registered class wins).
        kind: The `LayerKind`.
        source: Whose class it is, for reports (`'Keras'`, `'KerasHub'`).
    """

    layer_class: type | str
    kind: LayerKind
    source: str

    @property
    def qualname(self) -> str:
        if isinstance(self.layer_class, str):
            return self.layer_class
        return qualified_name(self.layer_class)


def _keras(names: str, kind: LayerKind) -> tuple[Default, ...]:
    return tuple(
        Default(getattr(keras.layers, n), kind, "Keras")
        for n in names.split()
        if hasattr(keras.layers, n)
    )


def _hub(names: tuple[str, ...], kind: LayerKind) -> tuple[Default, ...]:
    return tuple(Default(hub.qualified(n), kind, "KerasHub") for n in names)


DEFAULTS: tuple[Default, ...] = (
    *_keras(
        "BatchNormalization LayerNormalization GroupNormalization RMSNormalization",
        NORMALIZATION_FLOAT32_INSIDE,
    ),
    *_keras("UnitNormalization", NORMALIZATION_16BIT),
    *_keras("Softmax", SOFTMAX),
    *_keras("MultiHeadAttention GroupQueryAttention", ATTENTION_KERAS),
    *_keras("Attention AdditiveAttention", ATTENTION_16BIT),
    *_keras(
        "Conv1D Conv2D Conv3D Conv1DTranspose Conv2DTranspose Conv3DTranspose "
        "DepthwiseConv1D DepthwiseConv2D SeparableConv1D SeparableConv2D",
        CONVOLUTION,
    ),
    *_hub(hub.NORMALIZATION_FLOAT32_INSIDE_NAMES, NORMALIZATION_FLOAT32_INSIDE),
    *_hub(hub.NORMALIZATION_16BIT_NAMES, NORMALIZATION_16BIT),
    *_hub(hub.ATTENTION_FLOAT32_SOFTMAX_NAMES, ATTENTION_FLOAT32_SOFTMAX),
    *_hub(hub.ATTENTION_OWN_CODE_NAMES, ATTENTION_OWN_CODE),
)

_registered: dict[str, Default] = {}
_registered_lock = threading.Lock()


# The kinds a user can name in `register_layer_class`.
KINDS = {
    "normalization_float32_inside": NORMALIZATION_FLOAT32_INSIDE,
    "normalization_16bit": NORMALIZATION_16BIT,
    "softmax": SOFTMAX,
    "attention_own_code": ATTENTION_OWN_CODE,
    "attention_float32_softmax": ATTENTION_FLOAT32_SOFTMAX,
}


def register_layer_class(
    layer_class: type | str, kind: str, *, source: str = "registered"
) -> None:
    """Tells kmp what a layer class does with precision, so that its rules
    and reports treat it like the Keras layers kmp knows.

    The kinds:

    * `'normalization_float32_inside'`: a normalization that computes in
      float32 inside already. kmp leaves it and reports it.
    * `'normalization_16bit'`: a normalization that reduces in the compute
      dtype. It computes in float32 where its interface allows.
    * `'softmax'`: a softmax-like layer. It computes in float32 where its
      interface allows.
    * `'attention_own_code'`: an attention layer whose own code computes its
      scores in the compute dtype. kmp reports it.
    * `'attention_float32_softmax'`: an attention layer whose own code
      computes its softmax in float32. kmp reports it.

    A registration replaces any earlier one for the same class, and kmp's
    default for it. Subclasses match too, the most specific class first.

    Args:
        layer_class: A `keras.layers.Layer` subclass, or its qualified name
            (`'mylib.layers.FancyNorm'`), which matches without importing it.
        kind: One of the kinds above.
        source: Whose class it is, shown in reports.

    Raises:
        TypeError: if `layer_class` is not a layer class or a dotted name.
        ValueError: if `kind` is not one of the kinds above.

    Example:

    >>> class ScaledSoftmax(keras.layers.Layer):
    ...     def call(self, x):
    ...         return keras.ops.softmax(x * 2.0)
    >>> kmp.rules.register_layer_class(ScaledSoftmax, "softmax", source="mylib")
    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = kmp.prepare(keras.Sequential([
    ...     keras.Input((8,)), ScaledSoftmax(name="p"), keras.layers.Dense(2)]))
    >>> model.get_layer("p").compute_dtype
    'float32'
    """
    if isinstance(layer_class, type):
        if not issubclass(layer_class, keras.layers.Layer):
            raise TypeError(
                "register_layer_class() expects a keras.layers.Layer subclass "
                f"or its qualified name. Received: {layer_class.__name__}."
            )
    elif not (isinstance(layer_class, str) and "." in layer_class):
        raise TypeError(
            "register_layer_class() expects a keras.layers.Layer subclass or "
            "its qualified name, such as 'mylib.layers.FancyNorm'. Received: "
            f"{layer_class!r}."
        )
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(
            f"kind must be one of {', '.join(repr(k) for k in KINDS)}. "
            f"Received: {kind!r}."
        )
    entry = Default(layer_class, KINDS[kind], source)
    with _registered_lock:
        _registered[entry.qualname] = entry


def _clear_registrations() -> None:
    """Test hook: forgets every registration."""
    with _registered_lock:
        _registered.clear()


_DEFAULTS_BY_NAME = {d.qualname: d for d in DEFAULTS}


def default_for(layer: keras.layers.Layer) -> Default | None:
    """The registration or default that describes `layer`'s class (most
    specific class first), or None."""
    with _registered_lock:
        registered = dict(_registered)
    for cls in type(layer).__mro__:
        name = qualified_name(cls)
        entry = registered.get(name) or _DEFAULTS_BY_NAME.get(name)
        if entry is not None:
            return entry
        if cls is keras.layers.Layer:
            break
    return None


_SOFTMAX_ACTIVATIONS = ("softmax", "log_softmax")


def activation_name(layer: keras.layers.Layer) -> str | None:
    """`'softmax'` or `'log_softmax'` when the layer ends in one, else None."""
    fn = getattr(layer, "activation", None)
    if fn is None:
        return None
    for name in _SOFTMAX_ACTIVATIONS:
        if fn is getattr(keras.activations, name):
            return name
    name = getattr(fn, "__name__", None)
    return name if name in _SOFTMAX_ACTIVATIONS else None


def ends_in_sigmoid(layer: keras.layers.Layer) -> bool:
    """Whether the layer's `activation` is a sigmoid (a binary classifier's
    head: Keras's binary crossentropy reads the logits it keeps)."""
    fn = getattr(layer, "activation", None)
    return fn is not None and (
        fn is keras.activations.sigmoid or getattr(fn, "__name__", None) == "sigmoid"
    )


def kind_of(layer: keras.layers.Layer) -> tuple[LayerKind, str] | None:
    """(kind, source) of `layer`: by class (`DEFAULTS` and registrations),
    or `SOFTMAX` for any layer whose `activation` is softmax or log-softmax."""
    entry = default_for(layer)
    if entry is not None:
        return entry.kind, entry.source
    if activation_name(layer):
        return SOFTMAX, "Keras"
    return None


# Keras's attention classes, and the subclasses whose own code computes
# what Keras's computes from the same sublayers' outputs (kmp's, in
# `kmp.layers`, register themselves), most derived first.
_KERAS_ATTENTION = (keras.layers.GroupQueryAttention, keras.layers.MultiHeadAttention)
_registered_attention: list[type] = []


def register_attention_code(cls: type) -> None:
    """Declares that attention layers of `cls` (a subclass of a Keras
    attention layer) compute what Keras's attention code computes from the
    same sublayers' outputs, so that kmp's attention rules treat them as
    Keras's own; a subclass of `cls` that overrides its attention methods
    runs its own code."""
    if cls not in _registered_attention:
        _registered_attention.insert(0, cls)


def registered_attention_code() -> list[type]:
    """The attention classes registered with `register_attention_code`
    (kmp's own), most derived first."""
    return list(_registered_attention)


def keeps_keras_attention_code(layer: keras.layers.Layer) -> bool:
    """True when `layer` runs Keras's own attention code (or code registered
    as computing what it computes), which consumes its sublayers' outputs
    with `keras.ops` only (a subclass that overrides it may not)."""
    bases = (*_registered_attention, *_KERAS_ATTENTION)
    base = next((cls for cls in bases if isinstance(layer, cls)), None)
    return base is not None and keras_private.runs_attention_code_of(layer, base)


_said_unresolved: set[str] = set()


def warn_unresolved_hub_classes() -> None:
    """Warns (once per name) where the installed KerasHub no longer defines a
    class kmp has a rule for: layers of that class would silently lose it."""
    missing = [n for n in hub.check_installed() if n not in _said_unresolved]
    if not missing:
        return
    _said_unresolved.update(missing)
    import keras_hub

    _warn.warn(
        f"kmp has precision rules for KerasHub classes that keras-hub "
        f"{keras_hub.__version__} no longer defines where kmp looks for them: "
        f"{', '.join(missing)}. Layers of those classes (if they moved) get no "
        "rule from kmp: a normalization or attention softmax may compute in "
        "16 bits. Pin them with kmp.set_layer_policy('class:<ClassName>', "
        "'float32'), or use the keras-hub version kmp supports."
    )
