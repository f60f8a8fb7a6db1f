"""kmp: mixed-precision training for Keras 3 on TensorFlow or JAX.

>>> import kmp
>>> kmp.set_policy("mixed_bfloat16")
<Policy "mixed_bfloat16": compute=bfloat16, variables=float32>
"""

from kmp import callbacks
from kmp import debug
from kmp import hardware
from kmp import layers
from kmp import mixed_precision
from kmp import optimizers
from kmp import rules
from kmp import telemetry
from kmp.backend.finite import all_finite
from kmp.diagnostics.doctor import doctor
from kmp.diagnostics.report import precision_report
from kmp.planning.apply import prepare
from kmp.planning.export import export
from kmp.precision.policy import Policy
from kmp.precision.policy import PolicyError
from kmp.precision.policy import get_policy
from kmp.precision.policy import policy_scope
from kmp.precision.policy import register_policy
from kmp.precision.policy import set_policy
from kmp.precision.region import float32_scope
from kmp.precision.rules import clear_layer_policies
from kmp.precision.rules import set_layer_policy
from kmp.scaling.config import LossScaleError
from kmp.scaling.optimizer import LossScaleOptimizer
from kmp.training.compile import compile
from kmp.training.tape import ScaledGradientTape
from kmp.version import __version__

__all__ = [
    "LossScaleError",
    "LossScaleOptimizer",
    "Policy",
    "PolicyError",
    "ScaledGradientTape",
    "__version__",
    "all_finite",
    "callbacks",
    "clear_layer_policies",
    "compile",
    "debug",
    "doctor",
    "export",
    "float32_scope",
    "get_policy",
    "hardware",
    "layers",
    "mixed_precision",
    "optimizers",
    "policy_scope",
    "precision_report",
    "prepare",
    "register_policy",
    "rules",
    "set_layer_policy",
    "set_policy",
    "telemetry",
]
