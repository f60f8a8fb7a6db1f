"""Whether a model was compiled by `kmp.compile`, and saying so once when a kmp
tool meets one that was not.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.diagnostics.compiled_by import compiled_without_kmp
from kmp.diagnostics.compiled_by import note_compiled_without_kmp

__all__ = ["compiled_without_kmp", "note_compiled_without_kmp"]
