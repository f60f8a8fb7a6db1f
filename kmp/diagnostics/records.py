"""The loss-scale monitor's records and where they go: `StepRecord`, and its
writers (TensorBoard scalars, a CSV file, a PNG plot).

TensorBoard's event files are written with TensorBoard's record writer and
event protos, which import no TensorFlow (on JAX there may be none, and
TensorBoard's own file writer imports it wherever it is installed)."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os
import socket
import time

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
    "healed",
    "gradient_underflow",
)


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

    `loss` is the epoch's mean loss so far over the applied steps
    (`applied_loss`) where the logs have it, else Keras's `loss`.
    `overflow_layers` names the layers whose gradients were non-finite at the
    last skipped step of the interval; `forward` is True when the loss itself
    was inf/NaN (a forward overflow: every gradient is then non-finite).
    `healed` holds the moves `kmp.callbacks.OverflowHealer` made that a
    training step ran with since the last record (`"healed at step N:
    ..."`); `gradient_underflow` the fraction
    of gradient values float16 flushes to zero at the scale, where measured
    (`LossScaleMonitor(underflow_sample=...)`, at each epoch's end).
    """

    step: int
    epoch: int
    loss: float
    loss_scale: float | None
    skipped: int
    skipped_steps_total: int | None
    overflow_layers: tuple[str, ...] = ()
    forward: bool = False
    healed: tuple[str, ...] = ()
    gradient_underflow: float | None = None


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
    loss_ax.set_ylabel("loss (epoch mean of applied steps)")
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
    healed = [r.step for r in records if r.healed]
    for i, step in enumerate(healed):
        for ax in (loss_ax, scale_ax):
            ax.axvline(
                step,
                color="tab:purple",
                linestyle="--",
                label="a layer moved out of float16"
                if i == 0 and ax is loss_ax
                else None,
            )
    if healed:
        loss_ax.legend(loc="best")
    scale_ax.set_ylabel("loss scale")
    scale_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)


def _check_csv_header(path: str) -> None:
    """A CSV file the records are appended to has their columns."""
    if not os.path.exists(path) or not os.path.getsize(path):
        return
    try:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
    except (UnicodeDecodeError, csv.Error):
        header = ["(not a UTF-8 CSV file)"]
    if tuple(header) != CSV_FIELDS:
        raise ValueError(
            f"csv_path {path!r} exists with other columns than the monitor "
            f"writes: {','.join(header)!r}, where it writes "
            f"{','.join(CSV_FIELDS)!r} (a file written by another version, or "
            "by another program). Appending would misalign them: pass a new "
            "csv_path, or move that file away."
        )


def check_paths(
    log_dir: str | None, csv_path: str | None, plot_path: str | None
) -> None:
    """Raises `ValueError` for a destination that cannot be written, and
    `ImportError` for TensorBoard logs without TensorBoard or a plot without
    matplotlib (before training starts)."""
    if log_dir is not None:
        _check_writable_dir(log_dir, "log_dir")
        try:
            import tensorboard  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "log_dir needs TensorBoard: pip install tensorboard."
            ) from e
    if csv_path is not None:
        _check_writable_file(csv_path, "csv_path")
        _check_csv_header(csv_path)
    if plot_path is not None:
        _check_writable_file(plot_path, "plot_path")
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "plot_path needs matplotlib: pip install 'kmp[plot]'."
            ) from e


# Each event file's own number in this process, as TensorBoard numbers them.
# Written with its zeros: TensorBoard reads a folder's files in the order of
# their names, and those made in one second differ only here.
_EVENT_FILES = itertools.count()


def _event_file(log_dir: str):
    """A new TensorBoard event file in `log_dir`, named as TensorBoard names
    them, its first record the file's version: a record writer (`write`
    takes a serialized `Event`)."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter as Records

    stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    name = f"events.out.tfevents.{stamp}.{next(_EVENT_FILES):06d}"
    records = Records(open(os.path.join(log_dir, name), "wb"))  # noqa: SIM115
    version = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
    records.write(version.SerializeToString())
    return records


class EventFile:
    """A new TensorBoard event file in `log_dir`. Each `write` adds one
    event: scalars (`simple_value`, which TensorBoard reads) and texts at a
    step, flushed at once."""

    def __init__(self, log_dir: str):
        self._records = _event_file(log_dir)

    def write(
        self, step: int, values: list[tuple[str, float]], texts: list = ()
    ) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.text import summary_v2 as text_summary

        if not values and not texts:
            return
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(tag=tag, simple_value=value)
                for tag, value in values
            ]
        )
        for tag, text in texts:
            summary.value.extend(text_summary.text_pb(tag, text).value)
        event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary)
        self._records.write(event.SerializeToString())
        self._records.flush()

    def restart(self, step: int) -> None:
        """Marks a run that goes on from before `step`: TensorBoard drops
        what earlier files hold from `step` on (a stopped run's steps after
        the checkpoint a resumed run starts from)."""
        from tensorboard.compat.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        event = event_pb2.Event(wall_time=time.time(), step=step, session_log=start)
        self._records.write(event.SerializeToString())
        self._records.flush()

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()


class RecordWriter:
    """Writes `StepRecord`s to TensorBoard (`log_dir`, scalars under `kmp/`)
    and a CSV file (`csv_path`, appended to; the header once), either or
    both (None: not written)."""

    def __init__(self, log_dir: str | None, csv_path: str | None):
        self._writer = None
        self._csv_file = None
        self._csv = None
        self._row_at: int | None = None  # where the last CSV row starts
        if log_dir is not None:
            self._writer = EventFile(log_dir)
        if csv_path is not None:
            new = not os.path.exists(csv_path) or not os.path.getsize(csv_path)
            self._csv_file = open(csv_path, "a", newline="", encoding="utf-8")  # noqa: SIM115
            self._csv = csv.writer(self._csv_file)
            if new:
                self._csv.writerow(CSV_FIELDS)

    def write(self, r: StepRecord) -> None:
        """Writes one record to every destination (flushed at once: nothing
        is lost if training raises)."""
        if self._writer is not None:
            values = [("kmp/loss", r.loss)]
            if r.loss_scale is not None:
                values.append(("kmp/loss_scale", r.loss_scale))
            if r.skipped_steps_total is not None:
                values += [
                    ("kmp/skipped_steps", float(r.skipped)),
                    ("kmp/skipped_steps_total", float(r.skipped_steps_total)),
                ]
            if r.gradient_underflow is not None:
                values.append(("kmp/gradient_underflow", r.gradient_underflow))
            texts = []
            if r.overflow_layers:
                texts.append(("kmp/overflow_layers", _sources_text(r)))
            if r.healed:
                texts.append(("kmp/healed", "\n".join(r.healed)))
            self._writer.write(r.step, values, texts)
        if self._csv is not None:
            self._row_at = self._csv_file.tell()
            self._write_row(r)

    def amend(self, was: StepRecord, r: StepRecord) -> None:
        """Replaces the last record written, `was`, by `r` (its step, with
        what became known after it): the CSV row is written again in its
        place, and TensorBoard gets what `r` adds."""
        if self._writer is not None:
            values = []
            if r.gradient_underflow is not None and was.gradient_underflow is None:
                values.append(("kmp/gradient_underflow", r.gradient_underflow))
            # The step's whole text: TensorBoard shows one per step.
            texts = []
            if r.healed != was.healed:
                texts.append(("kmp/healed", "\n".join(r.healed)))
            self._writer.write(r.step, values, texts)
        if self._csv is not None and self._row_at is not None:
            self._csv_file.seek(self._row_at)
            self._csv_file.truncate()
            self._write_row(r)

    def _write_row(self, r: StepRecord) -> None:
        self._csv.writerow(
            [
                r.step,
                r.epoch,
                r.loss,
                "" if r.loss_scale is None else r.loss_scale,
                r.skipped,
                "" if r.skipped_steps_total is None else r.skipped_steps_total,
                _sources_text(r) if r.overflow_layers else "",
                # One move per line (a move's text has commas and ';').
                "\n".join(r.healed),
                "" if r.gradient_underflow is None else r.gradient_underflow,
            ]
        )
        self._csv_file.flush()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = self._csv = None
