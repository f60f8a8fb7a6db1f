"""Keras optimizers whose state takes half the memory: `kmp.optimizers.Adam`
and `kmp.optimizers.AdamW` keep their moments in bfloat16, with stochastic
rounding, beside float32 weights."""

from kmp.optimizers.adam import Adam
from kmp.optimizers.adam import AdamW

__all__ = ["Adam", "AdamW"]
