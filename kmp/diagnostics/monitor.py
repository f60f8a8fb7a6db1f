"""`kmp.callbacks.LossScaleMonitor`: the loss scale, skipped steps and
overflow sources while training, recorded every few steps.

The optimizer keeps the telemetry (scale, skip counters, overflow flags) as
variables; the monitor only reads them, at batch ends, outside the compiled
train step, and hands each record to `kmp.diagnostics.records`' writers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import keras

from kmp._base import backends
from kmp._base import warn as _warn
from kmp.backend import underflow as underflow_lib
from kmp.diagnostics import compiled_by
from kmp.diagnostics import debug
from kmp.diagnostics import records
from kmp.diagnostics import underflow
from kmp.planning import applied as applied_lib
from kmp.precision import traversal
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
    the skip count went up. A layer that `kmp.callbacks.OverflowHealer`
    moved out of float16 is in the record after a training step ran with
    it (`healed`, one move per line, with what its activations reached;
    TensorBoard text `kmp/healed`; a dashed line in the plot).

    With `underflow_sample=(x, y)`, at each epoch's end it also measures
    what float16 loses of the gradients at the current scale on that batch
    (`kmp.debug.gradient_underflow`: one float32 forward and backward pass,
    about a step's cost, nothing of the model changed): the fraction of
    gradient values flushed to zero goes to the record
    (`gradient_underflow`, TensorBoard `kmp/gradient_underflow`) and to the
    epoch's logs (`History`), each measure to `monitor.underflows`, and
    what helps the layer that loses the most (1% or more) is logged once.

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
        underflow_sample: `(x, y)` or `(x, y, sample_weight)`: a batch to
            measure gradient underflow on at each epoch's end, or None (on
            Keras's TensorFlow backend: the measure reads its tape).
        initial_step: The train steps made before this monitor's first
            `fit`, as in a resumed run: its records count on from there.

    Raises:
        ValueError: at construction, if a path cannot be written,
            `every_n_steps` is not a positive integer, `initial_step` is
            not an integer of 0 or more, or `underflow_sample` is not a
            tuple of two or three.
        ImportError: if `plot_path` is given and matplotlib is missing, or
            `log_dir` is given and TensorBoard is missing.
        NotImplementedError: for `underflow_sample` on another Keras
            backend.

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
        underflow_sample: tuple | None = None,
        initial_step: int = 0,
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
        if (
            isinstance(initial_step, bool)
            or not isinstance(initial_step, int)
            or initial_step < 0
        ):
            raise ValueError(
                f"initial_step must be an integer >= 0. Received: {initial_step!r}."
            )
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        self.csv_path = os.fspath(csv_path) if csv_path is not None else None
        self.plot_path = os.fspath(plot_path) if plot_path is not None else None
        self.every_n_steps = every_n_steps
        if underflow_sample is not None and not (
            isinstance(underflow_sample, tuple) and len(underflow_sample) in (2, 3)
        ):
            received = type(underflow_sample).__name__
            if isinstance(underflow_sample, tuple):
                received = f"a tuple of {len(underflow_sample)}"
            raise ValueError(
                "underflow_sample is a batch to measure gradient underflow on: "
                f"a tuple (x, y) or (x, y, sample_weight). Received: {received}."
            )
        if underflow_sample is not None:
            backends.require_tensorflow(
                "LossScaleMonitor(underflow_sample=...), which measures "
                "gradient underflow with TensorFlow's tape,",
                "Leave underflow_sample out: the monitor records the scale "
                "and the skipped steps without it.",
            )
        self.underflow_sample = underflow_sample
        self.underflows: list[tuple[int, underflow_lib.Underflow]] = []
        records.check_paths(self.log_dir, self.csv_path, self.plot_path)
        self.records: list[records.StepRecord] = []
        self._writer: records.RecordWriter | None = None
        self._step = initial_step  # train steps completed, over every fit
        self._epoch_start = initial_step
        self._epoch = 0
        self._last_recorded = initial_step
        self._last_total = 0
        self._last_logs: dict = {}
        self._warned = False
        self._reported: set[str] = set()  # the moves' texts recorded
        self._heals_count = -1  # applied_lib.heal_writes() when last looked
        self._advised = False
        self._measured: float | None = None  # this epoch's measure
        self._unmeasurable = False  # the sample could not run: said once

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
        self._measured = None

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the index of the epoch's last completed step, also with
        # steps_per_execution > 1.
        previous = self._step
        self._step = self._epoch_start + batch + 1
        self._last_logs = dict(logs or {})
        steps = (self.params or {}).get("steps")
        if self._measures() and steps and batch + 1 >= steps:
            # The epoch's last step: measured in its own record.
            self._measured = self._measure_underflow()
            self._record(self._measured)
        elif self._step // self.every_n_steps > previous // self.every_n_steps:
            self._record()

    def on_epoch_end(self, epoch, logs=None):
        if self._measures() and self._measured is None:
            # An epoch of unknown length: measured at its end.
            self._measured = self._measure_underflow()
        if self._step > self._last_recorded:
            # The epoch's tail (nothing is left uncounted), with the measure.
            self._record(self._measured)
        elif self._measured is not None and (
            self.records and self.records[-1].gradient_underflow is None
        ):
            # Its last step was recorded already: written again, with it.
            self._record(self._measured, again=True)
        heals = self._new_heals()
        if heals and self.records:
            # A move its last step ran with, seen after that step's record
            # (the healer's batch end came after this monitor's).
            self._record(self.records[-1].gradient_underflow, again=True, heals=heals)
        if self._measured is not None and logs is not None:
            logs["gradient_underflow"] = self._measured
        if self._writer is not None:
            self._writer.flush()

    def _measure_underflow(self) -> float | None:
        """This epoch's measure; None, said once, where the sample cannot
        run (training goes on, unmeasured)."""
        try:
            result = underflow.gradient_underflow(self.model, *self.underflow_sample)
        except ValueError as e:  # not compiled for a loss, and the like
            result = underflow_lib.Underflow(1.0, (), str(e))
        if result.error:
            _warn.warn(
                "kmp.callbacks.LossScaleMonitor could not measure gradient "
                f"underflow on underflow_sample ({result.error}); training goes "
                "on without it. Pass a batch the model trains on: (x, y) or "
                "(x, y, sample_weight)."
            )
            self._unmeasurable = True
            return None
        self.underflows.append((self._step, result))
        advice = result.advice()
        if advice and not self._advised:
            logger.warning("kmp.callbacks.LossScaleMonitor: %s", advice)
            self._advised = True
        return result.flushed_fraction

    def _measures(self) -> bool:
        return self.underflow_sample is not None and not self._unmeasurable

    def _new_heals(self) -> tuple[str, ...]:
        """The moves OverflowHealer made in this model that a training step
        ran with since the last look, each once (a block moved with its
        sublayers is one move), with what its activations reached (its
        layers are walked only when a move was recorded since)."""
        if applied_lib.heal_writes() == self._heals_count:
            return ()
        self._heals_count = applied_lib.heal_writes()
        found: dict[str, None] = {}
        for site in traversal.walk(self.model):
            heal = applied_lib.healed.get(site.layer)
            if heal is None or not heal.ran:
                continue
            if heal.text not in self._reported:
                self._reported.add(heal.text)
                found[heal.text] = None
        return tuple(found)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.plot_path is not None:
            self.plot(self.plot_path)

    def plot(self, path: str | os.PathLike) -> None:
        """Writes the PNG plot of the records so far (also after a failure)."""
        records.plot_records(self.records, os.fspath(path))

    def _record(
        self,
        underflow_fraction: float | None = None,
        again: bool = False,
        heals: tuple[str, ...] | None = None,
    ) -> None:
        if again and self.records:
            # The epoch's measure, or a move, at a step already recorded:
            # added to it.
            last = dataclasses.replace(
                self.records[-1],
                gradient_underflow=underflow_fraction,
                healed=self.records[-1].healed
                + (self._new_heals() if heals is None else heals),
            )
            was, self.records[-1] = self.records[-1], last
            if self._writer is not None:
                self._writer.amend(was, last)
            return
        logs = self._last_logs
        # What trained: a skipped step's NaN loss makes Keras's epoch mean
        # NaN for the rest of the epoch, which would hide the recovery.
        loss = float(logs.get("applied_loss", logs.get("loss", float("nan"))))
        opt = self._optimizer()
        scale_variable = telemetry.loss_scale_of(opt)
        scale = None
        if scale_variable is not None:
            logged = logs.get("loss_scale")
            scale = float(_numpy(scale_variable) if logged is None else logged)
        if not isinstance(opt, optimizer_lib.LossScaleOptimizer):
            record = records.StepRecord(
                self._step,
                self._epoch,
                loss,
                scale,
                0,
                None,
                healed=self._new_heals(),
                gradient_underflow=underflow_fraction,
            )
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
                healed=self._new_heals(),
                gradient_underflow=underflow_fraction,
            )
        self._last_recorded = self._step
        self.records.append(record)
        if self._writer is not None:
            self._writer.write(record)
