"""Keras callbacks that read kmp's loss-scale telemetry.

`LossScaleMonitor` writes the scale, skipped steps and overflow sources to
TensorBoard, CSV and a plot. `NonFiniteGuard` stops at the step a run
collapses, with its diagnosis. `OverflowHealer` moves a layer whose forward
pass overflows float16 to float32, or bfloat16, while training.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.diagnostics.guard import NonFiniteGuard
from kmp.diagnostics.healing import OverflowHealer
from kmp.diagnostics.monitor import LossScaleMonitor
from kmp.training.stall import TrainingCollapsedError

__all__ = [
    "LossScaleMonitor",
    "NonFiniteGuard",
    "OverflowHealer",
    "TrainingCollapsedError",
]
