"""Finding what went non-finite, and where (`last_overflow`, `find_nonfinite`),
the pre-training audit (`precision_audit`), the pre-training memory
estimate (`estimate_memory`), and what float16 loses of the gradients
(`gradient_underflow`).

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.backend.underflow import LayerUnderflow
from kmp.backend.underflow import Underflow
from kmp.diagnostics.audit import AuditReport
from kmp.diagnostics.audit import Risk
from kmp.diagnostics.audit import precision_audit
from kmp.diagnostics.debug import FLOAT16_MAX
from kmp.diagnostics.debug import LayerCheck
from kmp.diagnostics.debug import NonFiniteReport
from kmp.diagnostics.debug import OverflowSources
from kmp.diagnostics.debug import find_nonfinite
from kmp.diagnostics.debug import last_overflow
from kmp.diagnostics.debug import overflow_sources
from kmp.diagnostics.memory import MemoryEstimate
from kmp.diagnostics.memory import estimate_memory
from kmp.diagnostics.underflow import gradient_underflow

__all__ = [
    "FLOAT16_MAX",
    "AuditReport",
    "LayerCheck",
    "LayerUnderflow",
    "MemoryEstimate",
    "NonFiniteReport",
    "OverflowSources",
    "Risk",
    "Underflow",
    "estimate_memory",
    "find_nonfinite",
    "gradient_underflow",
    "last_overflow",
    "overflow_sources",
    "precision_audit",
]
