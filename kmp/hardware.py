"""What the machine can do (`capabilities`); `kmp.doctor()` says which
policy to use on it.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.backend.machine import capabilities

__all__ = ["capabilities"]
