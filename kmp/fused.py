"""The fused optimizer update: a Keras optimizer's `apply` as one XLA program,
and the rule `fused_update=None` follows.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.backend.fused import MIN_WEIGHTS
from kmp.backend.fused import TESTED
from kmp.backend.fused import FusedApply
from kmp.backend.fused import check_setting
from kmp.backend.fused import default_for_machine
from kmp.backend.fused import is_tested
from kmp.backend.fused import resolve
from kmp.backend.fused import rule
from kmp.backend.fused import weights_of

__all__ = [
    "MIN_WEIGHTS",
    "TESTED",
    "FusedApply",
    "check_setting",
    "default_for_machine",
    "is_tested",
    "resolve",
    "rule",
    "weights_of",
]
