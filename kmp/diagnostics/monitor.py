"""`kmp.callbacks.LossScaleMonitor`: the loss scale, skipped steps and
overflow sources while training, recorded every few steps.

The optimizer keeps the telemetry (scale, skip counters, overflow flags) as
variables; the monitor only reads them, at batch ends, outside the compiled
train step, and hands each record to `kmp.diagnostics.records`' writers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import keras

from kmp.diagnostics import compiled_by
from kmp.diagnostics import debug
from kmp.diagnostics import records
from kmp.scaling import optimizer as optimizer_lib
from kmp.scaling import registry
from kmp.scaling import telemetry

logger = logging.getLogger("kmp")


def _numpy(value: Any) -> Any:
    return keras.ops.convert_to_numpy(value).item()


class LossScaleMonitor(keras.callbacks.Callback):
    """Logs the loss scale, skipped steps and overflow sources while training.

    Every `every_n_steps` train steps, and at the last step of each epoch, it
    records the loss (Keras's running epoch mean), the loss scale, how many
    steps were skipped since the last record, the total, and which layers
    had non-finite gradients. Records go to TensorBoard (`log_dir`, scalars
    under `kmp/`), a CSV file (`csv_path`) and, at the end of training, a
    PNG plot of the loss and the loss scale with skipped steps marked
    (`plot_path`; needs matplotlib, the `plot` extra). They are written as
    they come (nothing is lost if training raises) and kept in
    `monitor.records`; `monitor.plot(path)` draws them at any time.

    Values come from the batch logs, which Keras has already read from the
    device; the optimizer's per-variable overflow record is read only when
    the skip count went up.

    With Keras's own `LossScaleOptimizer` it logs the loss and that
    optimizer's scale (Keras counts no skipped steps); with a
    `kmp.LossScaleOptimizer` in mode `'none'` (no scaling) the loss and the
    skipped steps; with any other optimizer the loss only, and says so once.

    Args:
        log_dir: TensorBoard log directory, or None.
        csv_path: CSV file to write, or None.
        plot_path: PNG file to write at the end of training, or None.
        every_n_steps: Record every N train steps (skips in between are
            counted, not lost).

    Raises:
        ValueError: at construction, if a path cannot be written or
            `every_n_steps` is not a positive integer.
        ImportError: if `plot_path` is given and matplotlib is missing.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model = kmp.compile(model, loss="mse",
    ...                     optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=1024))
    >>> monitor = kmp.callbacks.LossScaleMonitor(every_n_steps=2)
    >>> _ = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2, verbose=0,
    ...               callbacks=[monitor])
    >>> [(r.step, r.loss_scale) for r in monitor.records]
    [(2, 1024.0), (4, 1024.0)]
    """

    def __init__(
        self,
        log_dir: str | os.PathLike | None = None,
        csv_path: str | os.PathLike | None = None,
        plot_path: str | os.PathLike | None = None,
        every_n_steps: int = 1,
    ):
        super().__init__()
        if (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or (every_n_steps < 1)
        ):
            raise ValueError(
                f"every_n_steps must be an integer >= 1. Received: {every_n_steps!r}."
            )
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        self.csv_path = os.fspath(csv_path) if csv_path is not None else None
        self.plot_path = os.fspath(plot_path) if plot_path is not None else None
        self.every_n_steps = every_n_steps
        records.check_paths(self.log_dir, self.csv_path, self.plot_path)
        self.records: list[records.StepRecord] = []
        self._writer: records.RecordWriter | None = None
        self._step = 0  # train steps completed, over every fit
        self._epoch_start = 0
        self._epoch = 0
        self._last_recorded = 0
        self._last_total = 0
        self._last_logs: dict = {}
        self._warned = False

    def _optimizer(self):
        optimizers = registry.optimizers_of(self.model)
        return next(iter(optimizers.values())) if optimizers else None

    def on_train_begin(self, logs=None):
        opt = self._optimizer()
        kmp_opt = isinstance(opt, optimizer_lib.LossScaleOptimizer)
        if not self._warned:
            # A model compiled without kmp is named once (what it trains with
            # and the fix); the monitor then logs what that optimizer has.
            compiled_by.note_compiled_without_kmp(
                self.model, "kmp.callbacks.LossScaleMonitor"
            )
            if kmp_opt and opt.mode == "none":
                logger.info(
                    "kmp.callbacks.LossScaleMonitor: no loss scaling (mode "
                    "'none'); logging the loss and the skipped steps."
                )
            self._warned = True
        self._last_total = _numpy(opt.skipped_steps_total) if kmp_opt else 0
        if self._writer is None:
            self._writer = records.RecordWriter(self.log_dir, self.csv_path)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = self._step

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the index of the epoch's last completed step, also with
        # steps_per_execution > 1.
        previous = self._step
        self._step = self._epoch_start + batch + 1
        self._last_logs = dict(logs or {})
        if self._step // self.every_n_steps > previous // self.every_n_steps:
            self._record()

    def on_epoch_end(self, epoch, logs=None):
        if self._step > self._last_recorded:
            self._record()  # the epoch's tail: nothing is left uncounted
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.plot_path is not None:
            self.plot(self.plot_path)

    def plot(self, path: str | os.PathLike) -> None:
        """Writes the PNG plot of the records so far (also after a failure)."""
        records.plot_records(self.records, os.fspath(path))

    def _record(self) -> None:
        logs = self._last_logs
        loss = float(logs.get("loss", float("nan")))
        opt = self._optimizer()
        scale_variable = telemetry.loss_scale_of(opt)
        scale = None
        if scale_variable is not None:
            logged = logs.get("loss_scale")
            scale = float(_numpy(scale_variable) if logged is None else logged)
        if not isinstance(opt, optimizer_lib.LossScaleOptimizer):
            record = records.StepRecord(self._step, self._epoch, loss, scale, 0, None)
        else:
            logged = logs.get("skipped_steps_total")
            total = int(_numpy(opt.skipped_steps_total) if logged is None else logged)
            skipped = total - self._last_total
            self._last_total = total
            sources = debug.last_overflow(self.model) if skipped else None
            record = records.StepRecord(
                self._step,
                self._epoch,
                loss,
                scale,
                skipped,
                total,
                sources.layers if sources else (),
                bool(sources and sources.forward),
            )
        self._last_recorded = self._step
        self.records.append(record)
        if self._writer is not None:
            self._writer.write(record)
