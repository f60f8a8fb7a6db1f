"""The KerasHub layer classes kmp has rules for, by their qualified names
(`keras_hub.src....`, where KerasHub defines them: most are not in its public
API), so that they are recognised without importing KerasHub.

A name that the installed KerasHub no longer defines would silently lose its
rule (a normalization computed in 16 bits, say). `check_installed` finds
those: the plan calls it once KerasHub is imported and warns, naming them.
"""

from __future__ import annotations

import functools
import importlib
import sys

NORMALIZATION_FLOAT32_INSIDE_NAMES = (
    # Each casts to float32, normalizes, and casts back to the compute dtype.
    "models.gemma.rms_normalization.RMSNormalization",
    "models.gemma3.gemma3_layers.RMSNormalization",
    "models.llama.llama_layernorm.LlamaLayerNorm",
    "models.mistral.mistral_layer_norm.MistralLayerNormalization",
    "models.mixtral.mixtral_layer_norm.MixtralLayerNormalization",
    "models.qwen.qwen_layernorm.QwenLayerNorm",
    "models.qwen3.qwen3_layernorm.Qwen3LayerNorm",
    "models.phi3.phi3_layernorm.Phi3LayerNorm",
)
# Computes in the compute dtype (no float32 cast).
NORMALIZATION_16BIT_NAMES = ("models.t5.t5_layer_norm.T5LayerNorm",)
# Their own code: a float32 Softmax sublayer, query x key in the compute dtype
# (rotary embeddings and caches make the projections theirs).
ATTENTION_FLOAT32_SOFTMAX_NAMES = (
    "models.gemma.gemma_attention.CachedGemmaAttention",
    "models.llama.llama_attention.LlamaAttention",
    "models.mistral.mistral_attention.CachedMistralAttention",
    "models.qwen.qwen_attention.QwenAttention",
)
# A MultiHeadAttention subclass with a call of its own (key/value caches
# written with slice updates that do not promote): Keras's rule would change
# what those updates receive.
ATTENTION_OWN_CODE_NAMES = (
    "layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention",
)

PREFIX = "keras_hub.src."


def qualified(name: str) -> str:
    return PREFIX + name


def all_names() -> tuple[str, ...]:
    """Every qualified name kmp has a rule for."""
    return tuple(
        qualified(n)
        for n in (
            *NORMALIZATION_FLOAT32_INSIDE_NAMES,
            *NORMALIZATION_16BIT_NAMES,
            *ATTENTION_FLOAT32_SOFTMAX_NAMES,
            *ATTENTION_OWN_CODE_NAMES,
        )
    )


def _resolves(qualname: str) -> bool:
    """Whether the installed KerasHub defines a class under exactly this
    qualified name (kmp matches classes by `__module__` and `__qualname__`:
    a class that moved and is re-exported from its old module would not
    match)."""
    module, _, cls = qualname.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), cls, None)
    except Exception:  # a module that no longer imports, whatever the reason
        return False
    return (
        isinstance(found, type)
        and f"{found.__module__}.{found.__qualname__}" == qualname
    )


@functools.cache
def _unresolved() -> tuple[str, ...]:
    return tuple(n for n in all_names() if not _resolves(n))


def check_installed() -> tuple[str, ...]:
    """The names the installed KerasHub does not define (empty where it
    defines them all, and where KerasHub has not been imported: a model
    that uses none of its classes needs none of these rules)."""
    if "keras_hub" not in sys.modules:
        return ()
    return _unresolved()
