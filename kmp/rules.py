"""Precision rules beyond `kmp.set_layer_policy`: the kind of your own layer
classes (`register_layer_class`), how Keras's attention computes its scores
(`set_attention_scores`), and how convolutions compute under float16 on a
CPU (`set_cpu_convolutions`).

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.precision.attention import set_attention_scores
from kmp.precision.convolutions import set_cpu_convolutions
from kmp.precision.kinds import register_layer_class

__all__ = [
    "register_layer_class",
    "set_attention_scores",
    "set_cpu_convolutions",
]
