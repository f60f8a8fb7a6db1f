"""Loss-scale telemetry in `fit` logs: the scale and skipped steps, per epoch,
in `History` and the progress bar (`attach`; `kmp.compile` calls it).

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.scaling.registry import optimizers_of
from kmp.scaling.registry import register
from kmp.scaling.telemetry import LOG_KEYS
from kmp.scaling.telemetry import LossScaleTelemetry
from kmp.scaling.telemetry import loss_scale_of
from kmp.scaling.telemetry import metric_in_metrics
from kmp.scaling.telemetry import step_logs
from kmp.training.attach import attach

__all__ = [
    "LOG_KEYS",
    "LossScaleTelemetry",
    "attach",
    "loss_scale_of",
    "metric_in_metrics",
    "optimizers_of",
    "register",
    "step_logs",
]
