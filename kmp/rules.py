"""Precision rules: which layers compute in which dtype, and why: your rules
(`set_layer_policy`), the layer kinds kmp knows (and `register_layer_class`
for your own), the attention scores mode and the CPU convolutions mode.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.precision.attention import ATTENTION_MODES
from kmp.precision.attention import attention_scores
from kmp.precision.attention import set_attention_scores
from kmp.precision.convolutions import CONVOLUTION_MODES
from kmp.precision.convolutions import cpu_convolutions
from kmp.precision.convolutions import set_cpu_convolutions
from kmp.precision.kinds import ATTENTION_FLOAT32_SOFTMAX
from kmp.precision.kinds import ATTENTION_OWN_CODE
from kmp.precision.kinds import DEFAULTS
from kmp.precision.kinds import NORMALIZATION_16BIT
from kmp.precision.kinds import NORMALIZATION_FLOAT32_INSIDE
from kmp.precision.kinds import SOFTMAX
from kmp.precision.kinds import LayerKind
from kmp.precision.kinds import register_layer_class
from kmp.precision.kinds import unregister_layer_class
from kmp.precision.rules import FLOAT32
from kmp.precision.rules import LayerRule
from kmp.precision.rules import RuleConflictError
from kmp.precision.rules import clear_layer_policies
from kmp.precision.rules import layer_rules
from kmp.precision.rules import set_layer_policy

__all__ = [
    "ATTENTION_FLOAT32_SOFTMAX",
    "ATTENTION_MODES",
    "ATTENTION_OWN_CODE",
    "CONVOLUTION_MODES",
    "DEFAULTS",
    "FLOAT32",
    "NORMALIZATION_16BIT",
    "NORMALIZATION_FLOAT32_INSIDE",
    "SOFTMAX",
    "LayerKind",
    "LayerRule",
    "RuleConflictError",
    "attention_scores",
    "clear_layer_policies",
    "cpu_convolutions",
    "layer_rules",
    "register_layer_class",
    "set_attention_scores",
    "set_cpu_convolutions",
    "set_layer_policy",
    "unregister_layer_class",
]
