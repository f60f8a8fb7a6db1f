"""Keras callbacks that read kmp's loss-scale telemetry: `LossScaleMonitor`
(the scale, skipped steps and overflow sources, to TensorBoard, CSV and a
plot), `NonFiniteGuard` (a collapse detected at the step it happens, with
its diagnosis) and `OverflowHealer` (a layer whose forward pass overflows
float16 moved to float32, or bfloat16, while training).

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.diagnostics.collapse import TrainingCollapsedError
from kmp.diagnostics.guard import NonFiniteGuard
from kmp.diagnostics.healing import Heal
from kmp.diagnostics.healing import OverflowHealer
from kmp.diagnostics.monitor import LossScaleMonitor
from kmp.diagnostics.records import StepRecord
from kmp.diagnostics.records import plot_records

__all__ = [
    "Heal",
    "LossScaleMonitor",
    "NonFiniteGuard",
    "OverflowHealer",
    "StepRecord",
    "TrainingCollapsedError",
    "plot_records",
]
