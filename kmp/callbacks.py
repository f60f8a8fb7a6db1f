"""Keras callbacks that read kmp's loss-scale telemetry.

The optimizer keeps the telemetry (scale, skip counters, overflow flags) as
variables; these callbacks only read them, at batch ends, outside the
compiled train step.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import os
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from kmp import compiled_by
from kmp import debug
from kmp import loss_scale as loss_scale_lib
from kmp import optimizer as optimizer_lib
from kmp import policy as policy_lib
from kmp import quantization
from kmp import telemetry

logger = logging.getLogger("kmp")

PLOT_SIZE_INCHES = (8.0, 5.0)
PLOT_DPI = 100
CSV_FIELDS = (
    "step",
    "epoch",
    "loss",
    "loss_scale",
    "skipped",
    "skipped_steps_total",
    "overflow_layers",
)


def _numpy(value: Any) -> Any:
    return keras.ops.convert_to_numpy(value).item()


def _check_writable_dir(path: str, what: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{what}={path!r} cannot be created: {e.strerror}. Expected a "
            "writable directory; pass another path."
        ) from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"{what}={path!r} is not writable. Expected a writable directory; "
            "pass another path or fix its permissions."
        )


def _check_writable_file(path: str, what: str) -> None:
    _check_writable_dir(os.path.dirname(os.path.abspath(path)), f"the folder of {what}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{what}={path!r} exists and is not writable.")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One row of the monitor's log.

    `overflow_layers` names the layers whose gradients were non-finite at the
    last skipped step of the interval; `forward` is True when the loss itself
    was inf/NaN (a forward overflow: every gradient is then non-finite).
    """

    step: int
    epoch: int
    loss: float
    loss_scale: float | None
    skipped: int
    skipped_steps_total: int | None
    overflow_layers: tuple[str, ...] = ()
    forward: bool = False


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
        if self.log_dir is not None:
            _check_writable_dir(self.log_dir, "log_dir")
        if self.csv_path is not None:
            _check_writable_file(self.csv_path, "csv_path")
        if self.plot_path is not None:
            _check_writable_file(self.plot_path, "plot_path")
            try:
                import matplotlib  # noqa: F401
            except ImportError as e:
                raise ImportError(
                    "plot_path needs matplotlib: pip install 'kmp[plot]'."
                ) from e
        self.records: list[StepRecord] = []
        self._writer = None
        self._csv_file = None
        self._csv = None
        self._step = 0  # train steps completed, over every fit
        self._epoch_start = 0
        self._epoch = 0
        self._last_recorded = 0
        self._last_total = 0
        self._last_logs: dict = {}
        self._warned = False

    def _optimizer(self):
        optimizers = telemetry.optimizers_of(self.model)
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
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        if self.csv_path is not None and self._csv_file is None:
            new = not os.path.exists(self.csv_path) or not os.path.getsize(
                self.csv_path
            )
            self._csv_file = open(self.csv_path, "a", newline="", encoding="utf-8")  # noqa: SIM115
            self._csv = csv.writer(self._csv_file)
            if new:
                self._csv.writerow(CSV_FIELDS)

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
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = self._csv = None
        if self.plot_path is not None:
            self.plot(self.plot_path)

    def plot(self, path: str | os.PathLike) -> None:
        """Writes the PNG plot of the records so far (also after a failure)."""
        plot_records(self.records, os.fspath(path))

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
            record = StepRecord(self._step, self._epoch, loss, scale, 0, None)
        else:
            logged = logs.get("skipped_steps_total")
            total = int(_numpy(opt.skipped_steps_total) if logged is None else logged)
            skipped = total - self._last_total
            self._last_total = total
            sources = debug.last_overflow(self.model) if skipped else None
            record = StepRecord(
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
        self._write(record)

    def _write(self, r: StepRecord) -> None:
        if self._writer is not None:
            values = [("kmp/loss", r.loss)]
            if r.loss_scale is not None:
                values.append(("kmp/loss_scale", r.loss_scale))
            if r.skipped_steps_total is not None:
                values += [
                    ("kmp/skipped_steps", float(r.skipped)),
                    ("kmp/skipped_steps_total", float(r.skipped_steps_total)),
                ]
            # One raw Summary per step (TensorBoard reads `simple_value`
            # scalars): one op per record instead of one per scalar.
            summary = tf.compat.v1.Summary(
                value=[
                    tf.compat.v1.Summary.Value(tag=tag, simple_value=value)
                    for tag, value in values
                ]
            )
            with self._writer.as_default():
                tf.summary.experimental.write_raw_pb(
                    summary.SerializeToString(), step=r.step
                )
                if r.overflow_layers:
                    tf.summary.text(
                        "kmp/overflow_layers", _sources_text(r), step=r.step
                    )
        if self._csv is not None:
            self._csv.writerow(
                [
                    r.step,
                    r.epoch,
                    r.loss,
                    "" if r.loss_scale is None else r.loss_scale,
                    r.skipped,
                    "" if r.skipped_steps_total is None else r.skipped_steps_total,
                    _sources_text(r) if r.overflow_layers else "",
                ]
            )
            self._csv_file.flush()


def _sources_text(r: StepRecord) -> str:
    if r.forward:
        return "forward overflow (loss non-finite): " + ";".join(r.overflow_layers)
    return ";".join(r.overflow_layers)


def plot_records(records: list[StepRecord], path: str) -> None:
    """Writes a PNG of the loss and the loss scale over steps, skipped steps
    marked, 800x500 pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=PLOT_SIZE_INCHES, dpi=PLOT_DPI)
    FigureCanvasAgg(fig)
    loss_ax, scale_ax = fig.subplots(2, 1, sharex=True)
    steps = [r.step for r in records]
    skipped = [r for r in records if r.skipped]
    loss_ax.plot(steps, [r.loss for r in records], color="tab:blue")
    loss_ax.set_ylabel("loss (epoch mean so far)")
    loss_ax.set_title("kmp: loss and loss scale")
    scaled = [r for r in records if r.loss_scale is not None]
    if scaled:
        scale_ax.step(
            [r.step for r in scaled],
            [r.loss_scale for r in scaled],
            where="post",
            color="tab:green",
        )
        scale_ax.set_yscale("log", base=2)
    else:
        scale_ax.text(
            0.5,
            0.5,
            "no loss scale (no kmp loss scaling)",
            ha="center",
            va="center",
            transform=scale_ax.transAxes,
        )
    if skipped:
        scale_ax.scatter(
            [r.step for r in skipped],
            [r.loss_scale for r in skipped],
            marker="x",
            color="tab:red",
            label="skipped steps",
            zorder=3,
        )
        scale_ax.legend(loc="best")
    scale_ax.set_ylabel("loss scale")
    scale_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)


class TrainingCollapsedError(RuntimeError):
    """Training stalled: the loss scale sits at its floor and steps keep
    being skipped. `cause` is `'forward'` or `'gradient'`; `layers` names the
    layers involved; `report` is the full diagnosis text."""

    def __init__(self, report: str, cause: str, layers: tuple[str, ...]):
        super().__init__(report)
        self.report = report
        self.cause = cause
        self.layers = layers


class NonFiniteGuard(keras.callbacks.Callback):
    """Stops a run whose loss scale has collapsed, and says why.

    When the scale sits at its floor (or is static) and `max_consecutive_skips`
    steps in a row were skipped, nothing is training. The guard tells the two
    causes apart and names the layers involved:

    * non-finite *forward* values (the loss itself is inf/NaN: a layer
      overflows): `kmp.debug.find_nonfinite` on `probe` names the layer;
    * *gradient* overflow at every scale: the optimizer's per-variable record
      names the layers whose gradients overflow, and, with `probe` and
      `probe_targets`, a backward search names the layer that amplifies its
      input the most (exploding weights make their neighbours' gradients
      overflow).

    Under a `kmp.LossScaleOptimizer` in mode `'none'` (bfloat16, float32: no
    scale to lower) it acts after `max_consecutive_skips` skipped steps in a
    row, with the same diagnosis. With another optimizer (which applies
    non-finite steps) it acts when the loss is non-finite and the weights
    have become inf/NaN.

    Put it after a `LossScaleMonitor` in the callbacks list so that the
    monitor records the last step before the guard stops the run.

    It reads what it needs from the batch logs, which Keras has already
    read from the device: the running `skipped_steps_total` and the
    `loss_scale` that `kmp.compile` puts there (`kmp.telemetry`). It reads
    the optimizer's skip counters itself once at the start of `fit`, and
    after a batch only where the logs cannot tell: where they lack the
    telemetry (a `train_step` that returns its own logs), or, with
    `steps_per_execution` > 1, where some but not all steps since the last
    logs were skipped and the count in a row could be on either side of
    `max_consecutive_skips`.

    Args:
        max_consecutive_skips: Skipped steps in a row, at the floor, before
            acting.
        on_collapse: `'raise'` (a `TrainingCollapsedError`), `'stop'` (end
            training, log the diagnosis) or `'warn'` (log it once, go on).
        probe: Optional batch of inputs (as the model takes them) used to
            find the layers behind the collapse.
        probe_targets: Optional targets for `probe`, for the backward search.

    Example:

    >>> guard = kmp.callbacks.NonFiniteGuard(max_consecutive_skips=4)
    >>> guard.on_collapse
    'raise'
    """

    def __init__(
        self,
        max_consecutive_skips: int = 10,
        on_collapse: str = "raise",
        probe: Any = None,
        probe_targets: Any = None,
    ):
        super().__init__()
        if (
            isinstance(max_consecutive_skips, bool)
            or not isinstance(max_consecutive_skips, int)
            or max_consecutive_skips < 1
        ):
            raise ValueError(
                "max_consecutive_skips must be an integer >= 1. Received: "
                f"{max_consecutive_skips!r}."
            )
        if on_collapse not in ("raise", "stop", "warn"):
            raise ValueError(
                f"on_collapse must be 'raise', 'stop' or 'warn'. Received: "
                f"{on_collapse!r}."
            )
        if probe_targets is not None and probe is None:
            raise ValueError(
                "probe_targets was given without probe. Pass the inputs too: "
                "NonFiniteGuard(probe=x_batch, probe_targets=y_batch)."
            )
        self.max_consecutive_skips = max_consecutive_skips
        self.on_collapse = on_collapse
        self.probe = probe
        self.probe_targets = probe_targets
        self.diagnosis: TrainingCollapsedError | None = None
        # Skipped steps in a row after the last batch end, as bounds
        # (low, high) from the logs (equal where they tell it exactly), and
        # the skipped_steps_total they counted from; None where unknown.
        self._in_a_row: tuple[int, int] | None = None
        self._total: int | None = None
        self._steps_done = 0  # train steps of this epoch, at the last batch end

    def on_train_begin(self, logs=None):
        opt = optimizer_lib.of_model(self.model)
        self._in_a_row = self._total = None
        if opt is not None:  # one read per fit: where the logs count from
            in_a_row = int(_numpy(opt.consecutive_skips))
            self._in_a_row = (in_a_row, in_a_row)
            self._total = int(_numpy(opt.skipped_steps_total))

    def on_epoch_begin(self, epoch, logs=None):
        self._steps_done = 0

    def _logged(self, logs, opt, key: str) -> float | None:
        """`opt`'s value of telemetry `key` in the batch logs, or None."""
        optimizers = telemetry.optimizers_of(self.model)
        for label, candidate in optimizers.items():
            if candidate is opt:
                prefix = "" if len(optimizers) == 1 else f"{label}_"
                value = (logs or {}).get(f"{prefix}{key}")
                return None if value is None else float(value)
        return None

    def _skips_in_a_row(self, opt, batch: int, logs) -> bool:
        """Whether at least `max_consecutive_skips` steps in a row were
        skipped, up to this batch end.

        From the logs' `skipped_steps_total`: with `steps` steps since the
        last batch end and `skipped` of them skipped, none skipped resets
        the count, all skipped adds `steps` to it, and some bounds it to
        `0..skipped` (the applied steps came somewhere in between). The
        optimizer's `consecutive_skips` is read only where the logs lack
        the total or the bounds straddle the threshold.
        """
        steps = batch + 1 - self._steps_done
        self._steps_done = batch + 1
        total = self._logged(logs, opt, "skipped_steps_total")
        known = (
            total is not None
            and self._total is not None
            and self._in_a_row is not None
            and steps >= 1
            and total < loss_scale_lib.COUNTER_MAX  # a saturated total stops
        )
        if known:
            skipped = int(total) - self._total
            low, high = self._in_a_row
            if skipped == 0:
                self._in_a_row = (0, 0)
            elif skipped == steps:
                self._in_a_row = (low + steps, high + steps)
            elif 0 < skipped < steps:
                self._in_a_row = (0, skipped)
            else:  # the counters were reset or restored: the logs cannot tell
                known = False
        self._total = None if total is None else int(total)
        if known:
            low, high = self._in_a_row
            if high < self.max_consecutive_skips:
                return False
            if low >= self.max_consecutive_skips:
                return True
        in_a_row = int(_numpy(opt.consecutive_skips))
        self._in_a_row = (in_a_row, in_a_row)
        return in_a_row >= self.max_consecutive_skips

    def _collapsed(self, batch: int, logs) -> str | None:
        opt = optimizer_lib.of_model(self.model)
        if opt is None:
            loss = (logs or {}).get("loss")
            if loss is None or math.isfinite(float(loss)):
                return None
            return None if self._weights_finite() else "weights"
        if not self._skips_in_a_row(opt, batch, logs):
            return None
        if opt.mode in ("static", "none"):
            at_floor = True
        else:
            scale = self._logged(logs, opt, "loss_scale")
            if scale is None:
                scale = _numpy(opt.loss_scale)
            at_floor = scale <= opt.config.min_scale
        if not at_floor:
            return None
        return "gradient" if _numpy(opt.overflow_loss_finite) else "forward"

    def _weights_finite(self) -> bool:
        return all(
            bool(np.isfinite(keras.ops.convert_to_numpy(w)).all())
            for w in self.model.weights
        )

    def _diagnose(self, cause: str) -> TrainingCollapsedError:
        opt = optimizer_lib.of_model(self.model)
        if cause == "weights":
            if policy_lib.get(quantization.float_policy(self.model)).needs_loss_scaling:
                advice = (
                    "Use kmp.compile or a kmp.LossScaleOptimizer, which skips "
                    "such steps."
                )
            else:
                advice = (
                    "Without loss scaling (bfloat16, float32) every step is "
                    "applied, also a non-finite one. Restore the weights from "
                    "before the collapse (a checkpoint, or "
                    "keras.callbacks.BackupAndRestore), find the layer with "
                    "kmp.debug.find_nonfinite(model, x) on the failing batch, "
                    "and lower the learning rate or clip gradients "
                    "(global_clipnorm on the optimizer)."
                )
            name = type(getattr(opt, "inner_optimizer", self.model.optimizer))
            name = name.__name__
            return TrainingCollapsedError(
                "Training collapsed: the loss is inf/NaN and the weights have "
                f"become inf/NaN (the optimizer, {name}, applied a non-finite "
                f"step). {advice}",
                cause,
                (),
            )
        if opt.mode == "none":
            head = (
                f"Training collapsed: {self.max_consecutive_skips} steps in a row "
                "were skipped (no loss scaling: nothing to lower)."
            )
        else:
            head = (
                f"Training collapsed: {self.max_consecutive_skips} steps in a row "
                f"were skipped with the loss scale at its floor "
                f"({opt.config.min_scale:g})."
            )
        if cause == "gradient":
            layers = debug.last_overflow(self.model).layers
            names = ", ".join(repr(n) for n in layers)
            body = (
                "Cause: gradient overflow at every scale: the loss is finite, but "
                f"the gradients of {names} are inf/NaN."
            )
            if self.probe is not None and self.probe_targets is not None:
                report = debug.find_nonfinite(
                    self.model, self.probe, self.probe_targets
                )
                if report.found:
                    body += f"\n{report}"
            fix = (
                "Fix: if weights are exploding (the largest amplification above, "
                "or the learning rate), fix that; else compute those layers in "
                "float32: "
                + "; ".join(
                    f"kmp.set_layer_policy('name:{n}', 'float32')" for n in layers
                )
                + ", then kmp.prepare(model)."
            )
            return TrainingCollapsedError(f"{head}\n{body}\n{fix}", cause, layers)
        layers: tuple[str, ...] = ()
        body = "Cause: non-finite forward values: the loss itself is inf/NaN."
        if self.probe is not None:
            report = debug.find_nonfinite(self.model, self.probe)
            if report.found:
                layers = (report.layer,)
                body += f"\n{report}"
            else:
                body += " The probe batch ran finite; the failing batch differs."
        else:
            body += (
                " Pass probe=x_batch to NonFiniteGuard, or run "
                "kmp.debug.find_nonfinite(model, x_batch), to find the layer."
            )
        return TrainingCollapsedError(f"{head}\n{body}", cause, layers)

    def on_train_batch_end(self, batch, logs=None):
        if self.diagnosis is not None and self.on_collapse == "warn":
            return  # said once; no more per-step checks
        cause = self._collapsed(batch, logs)
        if cause is None:
            return
        self.diagnosis = self._diagnose(cause)
        if self.on_collapse == "raise":
            raise self.diagnosis
        logger.warning("%s", self.diagnosis.report)
        if self.on_collapse == "stop":
            self.model.stop_training = True
