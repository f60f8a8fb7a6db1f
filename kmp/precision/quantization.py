"""Quantized and LoRA layers as kmp sees them.

Keras quantizes a layer (`model.quantize("int8" | "int4" | "float8" | ...)`)
by giving it a quantized dtype policy such as `int4/128_from_mixed_bfloat16`:
a quantization mode and the float policy (its *float part*) the layer still
computes in around the quantized weights. kmp's precision rules act on that
float part only and never undo a quantization: moving such a layer to
float32 gives it `int4/128_from_float32`.

One combination Keras refuses: `int8` computing in `float16` (the layer
sums int8 products in int32 and casts the sums to the compute dtype, which
overflows float16's range). kmp keeps such layers out of float16 (see
`refusal`) and says so in the precision report and the audit.

A layer loaded from a quantized KerasHub preset may hold a
`keras.dtype_policies.DTypePolicyMap` (policies by layer path) rather than
a policy; `policy_of` reads the policy that applies to the layer.

Example:

>>> kmp.set_policy("mixed_bfloat16")
<Policy "mixed_bfloat16": ...>
>>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
>>> model.quantize("int8")
>>> dense = model.layers[0]
>>> kmp.precision.quantization.mode(dense), kmp.precision.quantization.float_part(dense)
('int8', 'mixed_bfloat16')
>>> kmp.precision.quantization.set_float_part(dense, "float32")
>>> dense.dtype_policy.name
'int8_from_float32'
"""

from __future__ import annotations

import re
from typing import Any

import keras

from kmp.precision import traversal

# Keras's own refusal (`Layer.quantize`, `QuantizedDTypePolicy`), with why.
_REFUSED = {
    ("int8", "float16"): (
        "Keras does not compute int8 layers in float16 (their int32 sums overflow it)"
    ),
}


def policy_of(layer: keras.layers.Layer) -> keras.DTypePolicy:
    """The dtype policy that applies to `layer`: its own, or its entry in
    the `DTypePolicyMap` it holds (the map's default for a layer Keras gave
    no path, as Keras reads it)."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def mode(layer: keras.layers.Layer) -> str | None:
    """The layer's quantization mode (`'int8'`, `'int4'`, `'float8'`,
    `'gptq'`, `'awq'`), or None for a layer that is not quantized."""
    return policy_of(layer).quantization_mode


def float_name(policy: keras.DTypePolicy) -> str:
    """The Keras name of a policy's float part: the policy's own name for a
    float policy; for a quantized one, the float policy it computes in.

    Read from the dtypes, not from the quantized policy's `source_name`:
    serializing a KerasHub backbone (`get_config`, so every save) sets the
    live policies' names to None through `DTypePolicyMap.get_config`."""
    if policy.quantization_mode is None and policy.name is not None:
        return policy.name
    compute, variable = policy.compute_dtype, policy.variable_dtype
    if compute == variable:
        return compute
    if variable == "float32":
        return f"mixed_{compute}"
    return policy.get_config()["source_name"]


def float_part(layer: keras.layers.Layer) -> str:
    """The Keras name of the float policy `layer` computes in."""
    return float_name(policy_of(layer))


def float_policy(layer: keras.layers.Layer) -> keras.DTypePolicy:
    """The float policy `layer` computes in (its own policy when it is not
    quantized)."""
    policy = policy_of(layer)
    if policy.quantization_mode is None:
        return policy
    return keras.dtype_policies.get(float_name(policy))


def refusal(quantization_mode: str | None, compute_dtype: str) -> str | None:
    """Why Keras refuses a quantized layer computing in `compute_dtype`, or
    None when it does not."""
    return _REFUSED.get((quantization_mode, compute_dtype))


def with_float_part(
    policy: keras.DTypePolicy, float_policy_name: str
) -> keras.DTypePolicy:
    """`policy` with its float part replaced: the float policy itself for a
    float `policy`, the same quantization (mode and settings) from
    `float_policy_name` for a quantized one.

    Raises:
        ValueError: for a combination Keras refuses (int8 from float16).
    """
    if policy.quantization_mode is None:
        return keras.dtype_policies.get(float_policy_name)
    config = dict(policy.get_config(), source_name=float_policy_name)
    return type(policy).from_config(config)


def set_float_part(layer: keras.layers.Layer, float_policy_name: str) -> None:
    """Makes `layer` compute in `float_policy_name`, keeping its quantization,
    through Keras's `layer.dtype_policy` setter."""
    layer.dtype_policy = with_float_part(policy_of(layer), float_policy_name)


def snapshot(layer: keras.layers.Layer) -> tuple:
    """What `restore` needs to put the layer's policy back exactly as it is
    (the policy object; for a `DTypePolicyMap`, whether the layer's path had
    an entry of its own)."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and layer.path:
        own = layer.path in policy
        return (True, own, policy[layer.path] if own else None)
    return (False, True, policy)


def restore(layer: keras.layers.Layer, saved: tuple) -> None:
    """Puts back the policy `snapshot` saved."""
    in_map, had_entry, policy = saved
    if not in_map:
        layer.dtype_policy = policy
        return
    entries = layer.dtype_policy
    if layer.path in entries:
        del entries[layer.path]  # a map refuses to overwrite a key
    if had_entry:
        entries[layer.path] = policy


def lora_rank(layer: keras.layers.Layer) -> int:
    """The LoRA rank of a layer with LoRA enabled (`layer.enable_lora`), else 0."""
    if not getattr(layer, "lora_enabled", False):
        return 0
    return int(getattr(layer, "lora_rank", 0) or 0)


def trains(layer: keras.layers.Layer) -> str:
    """Which of a layer's own weights train: `'yes'` (all), `'no'` (none),
    `'adapters'` (its LoRA factors, and its bias), `'partly'`, or `''` for a
    layer without weights of its own. A quantized layer's quantization
    parameters (scales, zero points, float8's amax histories, which Keras
    overwrites rather than trains) are not weights here."""
    quantized = mode(layer) is not None
    weights = [
        w
        for w in _own_weights(layer)
        if not getattr(w, "overwrite_with_gradient", False)
        and not (quantized and _QUANTIZATION_PARAMETER.search(w.name))
    ]
    if not weights:
        return ""
    trainable = [w for w in weights if w.trainable and layer.trainable]
    if len(trainable) == len(weights):
        return "yes"
    if not trainable:
        return "no"
    if lora_rank(layer) and all(
        LORA_FACTOR.fullmatch(w.name) or w.name == "bias" for w in trainable
    ):
        return "adapters"
    return "partly"


# A LoRA factor's variable name (its layer's path is the rest of its path):
# Dense/EinsumDense `lora_kernel_a`, Embedding `lora_embeddings_a`.
LORA_FACTOR = re.compile(r"lora_(kernel|embeddings)_([ab])")
_QUANTIZATION_PARAMETER = re.compile(r"(_scale|_zero|g_idx|amax_history)$")


def _own_weights(layer: keras.layers.Layer) -> list[Any]:
    inner = {id(w) for child in traversal.children(layer) for w in child.weights}
    return [w for w in layer.weights if id(w) not in inner]
