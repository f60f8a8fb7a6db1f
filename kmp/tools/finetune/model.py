"""The model `kmp finetune` trains: a KerasHub causal LM loaded from a
local preset under the run's policy, its base quantized, LoRA added."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras
import numpy as np

from kmp.backend import live_tensors
from kmp.precision import traversal

# The layers `lora.targets: all-linear` puts adapters on.
LINEAR = (keras.layers.Dense, keras.layers.EinsumDense)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A model's parameter counts and the bytes training holds for them."""

    trainable: int
    total: int  # the base's parameters as loaded, and the adapters'
    weights_bytes: int  # every weight, as stored (int4 ones two to a byte)
    gradients_bytes: int  # one gradient per trainable weight

    @classmethod
    def of(cls, model: keras.Model, base: int) -> Sizes:
        """The sizes of `model`, whose base had `base` parameters before
        it was quantized (int4 stores two to an element) and LoRA added."""
        adapters = sum(
            count([site.layer.lora_kernel_a, site.layer.lora_kernel_b])
            for site in traversal.walk(model)
            if getattr(site.layer, "lora_enabled", False)
        )
        return cls(
            # Float8 scales are overwritten, not learned: no parameters.
            trainable=count(
                v
                for v in model.trainable_weights
                if not getattr(v, "overwrite_with_gradient", False)
            ),
            total=base + adapters,
            weights_bytes=live_tensors.nbytes(model.weights),
            gradients_bytes=live_tensors.nbytes(model.trainable_weights),
        )


def count(variables) -> int:
    """The number of values `variables` hold."""
    return sum(int(np.prod(v.shape)) for v in variables)


def load(preset: str) -> Any:
    """The causal LM of a preset directory, its layers under the global
    policy (the preset's saved dtype would otherwise win)."""
    import keras_hub

    return keras_hub.models.CausalLM.from_preset(
        preset, dtype=keras.config.dtype_policy()
    )


def quantize(lm: Any, mode: str) -> None:
    """Quantizes the backbone's weights to `mode`. For int8, the tied token
    embedding stays in float: Keras's int8 `ReversibleEmbedding` passes
    gradients back about 5x too small."""
    keep = (lambda layer: layer.name != "token_embedding") if mode == "int8" else None
    with warnings.catch_warnings():  # "layer X does not have a quantize method"
        warnings.simplefilter("ignore", UserWarning)
        lm.backbone.quantize(mode, filters=keep)


def lora_targets(lm: Any, targets: str | list[str]) -> list[str]:
    """The names of the backbone's layers that `targets` puts LoRA on.

    Raises:
        ValueError: for a name no layer that takes LoRA has.
    """
    backbone = lm.backbone
    if targets == "default":
        return list(backbone.default_lora_layer_names())
    takes = [
        site.layer
        for site in traversal.walk(backbone)
        if hasattr(site.layer, "enable_lora") and site.layer.weights
    ]
    if targets == "all-linear":
        return sorted({layer.name for layer in takes if isinstance(layer, LINEAR)})
    names = sorted({layer.name for layer in takes})
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise ValueError(
            f"lora.targets: no layer of {type(backbone).__name__} that takes "
            f"LoRA is named {', '.join(map(repr, unknown))}. Expected names "
            f"from: {', '.join(names)}. Fix: use those names, or 'all-linear'."
        )
    return list(targets)


def add_lora(lm: Any, rank: int, alpha: float, names: list[str]) -> None:
    """Freezes the backbone and puts LoRA of `rank` on the layers `names`;
    each adapter's output is scaled by `alpha / rank`."""
    lm.backbone.enable_lora(rank, target_layer_names=names)
    for site in traversal.walk(lm):
        if getattr(site.layer, "lora_enabled", False):
            site.layer.lora_alpha = alpha
