"""tf.keras 2's mixed-precision API, mapped onto kmp: code written for it runs
with its import line changed (`from kmp import mixed_precision`).

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.training.tf_keras import LossScaleOptimizer
from kmp.training.tf_keras import Policy
from kmp.training.tf_keras import global_policy
from kmp.training.tf_keras import set_global_policy

__all__ = ["LossScaleOptimizer", "Policy", "global_policy", "set_global_policy"]
