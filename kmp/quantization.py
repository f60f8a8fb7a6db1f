"""Quantized and LoRA layers as kmp sees them: the float policy a quantized
layer computes in, what trains, and adapters that cannot learn.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.precision.quantization import float_name
from kmp.precision.quantization import float_part
from kmp.precision.quantization import float_policy
from kmp.precision.quantization import lora_rank
from kmp.precision.quantization import mode
from kmp.precision.quantization import policy_of
from kmp.precision.quantization import refusal
from kmp.precision.quantization import restore
from kmp.precision.quantization import set_float_part
from kmp.precision.quantization import snapshot
from kmp.precision.quantization import trains
from kmp.precision.quantization import with_float_part
from kmp.scaling.lora import dead_adapters
from kmp.scaling.lora import warn_dead_adapters

__all__ = [
    "dead_adapters",
    "float_name",
    "float_part",
    "float_policy",
    "lora_rank",
    "mode",
    "policy_of",
    "refusal",
    "restore",
    "set_float_part",
    "snapshot",
    "trains",
    "warn_dead_adapters",
    "with_float_part",
]
