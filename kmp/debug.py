"""Finding what went non-finite, and where (`find_nonfinite`,
`last_overflow`); the audit before training (`precision_audit`); what
training will hold in memory (`estimate_memory`); what float16 loses of the
gradients (`gradient_underflow`); and whether replicas agree
(`verify_replicas`).

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.diagnostics.audit import precision_audit
from kmp.diagnostics.debug import find_nonfinite
from kmp.diagnostics.debug import last_overflow
from kmp.diagnostics.memory import estimate_memory
from kmp.diagnostics.replicas import verify_replicas
from kmp.diagnostics.underflow import gradient_underflow

__all__ = [
    "estimate_memory",
    "find_nonfinite",
    "gradient_underflow",
    "last_overflow",
    "precision_audit",
    "verify_replicas",
]
