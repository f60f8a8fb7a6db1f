"""LoRA adapters that cannot learn: both factors all zero (what Keras's
`.keras` format leaves after loading), found by reading the values eagerly
at an optimizer's first apply (`warn_dead_adapters`), and said with both
ways to go on."""

from __future__ import annotations

from typing import Any

import keras

from kmp._base import warn as _warn
from kmp.backend import graph
from kmp.precision import quantization


def dead_adapters(variables) -> list[str]:
    """The layers whose LoRA factors among `variables` are both all zero, by
    path: their gradients are zero, so they cannot learn.

    That is the state Keras's `.keras` format leaves: saving merges each
    layer's LoRA product into its kernel or embeddings (quantized again for
    int8/int4), and loading sets both factors to zero. Reads the
    values eagerly (also while a step is being traced)."""
    factors: dict[str, dict[str, Any]] = {}
    for v in variables:
        match = quantization.LORA_FACTOR.fullmatch(getattr(v, "name", "") or "")
        if match:
            layer = v.path.rsplit("/", 1)[0]
            factors.setdefault(layer, {})[match.group(2)] = v
    dead = []
    with graph.init_scope():
        for layer, pair in factors.items():
            if len(pair) == 2 and all(
                not keras.ops.convert_to_numpy(keras.ops.any(v != 0))
                for v in pair.values()
            ):
                dead.append(layer)
    return dead


def warn_dead_adapters(optimizer: Any, variables) -> None:
    """Warns where `dead_adapters(variables)` names layers, with both ways to
    go on. Reads them once per optimizer, at its first apply (which calls
    it each time): later applies cost nothing."""
    if not _warn.once(optimizer, "dead adapters"):
        return
    dead = dead_adapters(variables)
    if not dead:
        return
    _warn.warn(
        f"The LoRA adapters of {', '.join(dead)} are all zero, so they "
        "cannot learn (both factors zero: their gradients are zero). That is what "
        "keras.models.load_model leaves: Keras's .keras format merges the "
        "adapters into the kernel when saving and zeroes them when loading. "
        "To continue LoRA fine-tuning exactly where it stopped, save with "
        "tf.train.Checkpoint(model=model, optimizer=model.optimizer), which "
        "keeps the adapters; to start new adapters on the merged model, "
        "give lora_kernel_a random values: "
        "layer.lora_kernel_a.assign(keras.initializers.HeUniform()("
        "layer.lora_kernel_a.shape))."
    )
