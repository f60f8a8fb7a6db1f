"""Finding what went non-finite, and where (`last_overflow`, `find_nonfinite`),
the pre-training audit (`precision_audit`), and the pre-training memory
estimate (`estimate_memory`).

A public module of kmp's: it only re-exports, from where each name lives.
"""

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

__all__ = [
    "FLOAT16_MAX",
    "AuditReport",
    "LayerCheck",
    "MemoryEstimate",
    "NonFiniteReport",
    "OverflowSources",
    "Risk",
    "estimate_memory",
    "find_nonfinite",
    "last_overflow",
    "overflow_sources",
    "precision_audit",
]
