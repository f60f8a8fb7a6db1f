"""Loss-scale telemetry in `fit` logs: the scale and skipped steps, per epoch,
in `History` and the progress bar (`attach`; `kmp.compile` calls it).

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.training.attach import attach

__all__ = ["attach"]
