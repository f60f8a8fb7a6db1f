"""kmp: mixed-precision training for Keras 3 on TensorFlow.

>>> import kmp
>>> kmp.set_policy("mixed_bfloat16")
<Policy "mixed_bfloat16": compute=bfloat16, variables=float32>
"""

from kmp import callbacks
from kmp import compiled_by
from kmp import debug
from kmp import distribute
from kmp import fused
from kmp import hardware
from kmp import mixed_precision
from kmp import quantization
from kmp import rules
from kmp import telemetry
from kmp.hardware import doctor
from kmp.loss_scale import LossScaleConfig
from kmp.loss_scale import LossScaleError
from kmp.loss_scale import all_finite
from kmp.model import compile
from kmp.optimizer import LossScaleOptimizer
from kmp.planning import prepare
from kmp.policy import Policy
from kmp.policy import PolicyError
from kmp.policy import get_policy
from kmp.policy import list_policies
from kmp.policy import policy_scope
from kmp.policy import register_policy
from kmp.policy import set_policy
from kmp.report import LayerPrecision
from kmp.report import PrecisionReport
from kmp.report import precision_report
from kmp.rules import LayerRule
from kmp.rules import RuleConflictError
from kmp.rules import clear_layer_policies
from kmp.rules import layer_rules
from kmp.rules import set_layer_policy
from kmp.tape import ScaledGradientTape
from kmp.version import __version__

__all__ = [
    "LayerPrecision",
    "LayerRule",
    "LossScaleConfig",
    "LossScaleError",
    "LossScaleOptimizer",
    "Policy",
    "PolicyError",
    "PrecisionReport",
    "RuleConflictError",
    "ScaledGradientTape",
    "__version__",
    "all_finite",
    "callbacks",
    "clear_layer_policies",
    "compile",
    "compiled_by",
    "debug",
    "distribute",
    "doctor",
    "fused",
    "get_policy",
    "hardware",
    "layer_rules",
    "list_policies",
    "mixed_precision",
    "policy_scope",
    "precision_report",
    "prepare",
    "quantization",
    "register_policy",
    "rules",
    "set_layer_policy",
    "set_policy",
    "telemetry",
]
