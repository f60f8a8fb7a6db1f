"""What `kmp finetune` shows and records as it trains: a progress bar of
updates with the loss, learning rate, loss scale, skipped steps, tokens per
second and peak memory, and the same values kept for the run's metrics."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import keras

from kmp.backend import machine
from kmp.diagnostics import records as records_lib
from kmp.tools import runs


@keras.saving.register_keras_serializable(package="kmp_finetune")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate rises linearly to `peak` over `warmup` updates, then
    stays (`constant`) or decays to 0 at `total` updates (`linear`,
    `cosine`). Updates are counted from the optimizer's iterations, which
    count every batch: with gradient accumulation, `accumulation` batches
    make one update."""

    def __init__(
        self,
        peak: float,
        total: int,
        warmup: int,
        shape: str = "cosine",
        accumulation: int = 1,
    ):
        self.peak = peak
        self.total = total
        self.warmup = warmup
        self.shape = shape
        self.accumulation = accumulation

    def __call__(self, iterations):
        ops = keras.ops
        update = ops.cast(ops.floor_divide(iterations, self.accumulation), "float32")
        rise = self.peak * (update + 1) / max(self.warmup, 1)
        progress = ops.clip(
            (update - self.warmup) / max(self.total - self.warmup, 1), 0.0, 1.0
        )
        if self.shape == "constant":
            after = ops.convert_to_tensor(self.peak, "float32")
        elif self.shape == "linear":
            after = self.peak * (1.0 - progress)
        else:
            after = self.peak * 0.5 * (1.0 + ops.cos(math.pi * progress))
        return ops.where(update < self.warmup, rise, after)

    def get_config(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            "total": self.total,
            "warmup": self.warmup,
            "shape": self.shape,
            "accumulation": self.accumulation,
        }


class Updates(keras.callbacks.Callback):
    """Counts the run's updates, one per `accumulation` batches from
    `start`, and calls `on_update(logs)` at each (`self.update` is its
    number)."""

    def __init__(self, accumulation: int, start: int = 0):
        super().__init__()
        self.accumulation = accumulation
        self.update = start
        self._batches = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches += 1
        if self._batches % self.accumulation == 0:
            self.update += 1
            self.on_update(logs if logs is not None else {})

    def on_update(self, logs: dict) -> None:
        """Called at the end of each update, with the batch logs."""


class Progress(Updates):
    """A progress bar of updates, printed as a line every `logging_steps`
    updates (so that it reads the same in a terminal and in a log file).

    Each line shows the loss (Keras's running mean since the last
    evaluation or epoch), the accuracy of the response tokens, the learning
    rate, the loss scale (under float16) and the skipped steps, tokens per
    second since the last line, and peak memory: the process's and the
    tensors' (where the backend counts them). Each line's values are kept
    in `records`, added to the batch logs, and written to TensorBoard.

    Args:
        total: The updates the run makes.
        logging_steps: Updates between lines.
        accumulation: Batches per update.
        tokens_per_batch: The tokens (padding left out) a batch holds.
        schedule: The learning rate schedule (of the optimizer's
            iterations), read here from the batches applied (those run, less
            those skipped): on JAX, the optimizer's own variables reach the
            host only at each epoch's end.
        first_update: The update the run starts after (when resumed).
        log_dir: The TensorBoard log directory, or None. Values go under
            `finetune/`, at the step of the batch that ends their update
            (the steps `LossScaleMonitor` counts). A resumed run's drop
            what the stopped run wrote after its checkpoint.
    """

    def __init__(
        self,
        total: int,
        logging_steps: int,
        accumulation: int,
        tokens_per_batch: float,
        schedule: WarmupSchedule,
        first_update: int = 0,
        log_dir: str | None = None,
    ):
        super().__init__(accumulation, first_update)
        self._events = None
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            self._events = records_lib.EventFile(log_dir)
            if first_update:  # what a stopped run wrote after it is dropped
                self._events.restart(first_update * accumulation + 1)
        self.schedule = schedule
        self.total = total
        self.logging_steps = logging_steps
        self.tokens_per_batch = tokens_per_batch
        self.records: list[dict[str, float]] = []
        self._since = self._began = time.perf_counter()
        self._tokens = 0.0
        self._first = first_update

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Tokens per second count training alone, not evaluations between.
        self._since, self._tokens = time.perf_counter(), 0.0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._tokens += self.tokens_per_batch
        super().on_train_batch_end(batch, logs)

    def on_update(self, logs: dict) -> None:
        if self.update % self.logging_steps and self.update != self.total:
            return
        now = time.perf_counter()
        record = {"update": self.update}
        for name in ("loss", "accuracy"):
            if name in logs:
                record[name] = float(logs[name])
        # The optimizer counts the micro-batches it applied: a skipped one
        # (inf/NaN gradients) moves its schedule on no further.
        # (kmp.compile's telemetry puts the count in the logs; a model
        # without it has skipped none.)
        applied = self.update * self.accumulation - logs.get("skipped_steps_total", 0)
        lr = self.schedule(max(int(applied) - 1, 0))
        record["learning_rate"] = float(keras.ops.convert_to_numpy(lr))
        for name in ("loss_scale", "skipped_steps_total"):
            if name in logs:
                record[name] = float(logs[name])
        record["tokens_per_second"] = self._tokens / max(now - self._since, 1e-9)
        record["memory_gib"] = runs.process_peak_mb() / 1024
        tensors = machine.tensors_peak_mb()
        if tensors is not None:
            record["tensors_mib"] = tensors
        self.records.append(record)
        values = {k: v for k, v in record.items() if k != "update"}
        logs.update(values)
        self.log(self.update, values)
        self._since, self._tokens = now, 0.0
        print(self.line(record, now), flush=True)

    def log(self, update: int, values: dict[str, float]) -> None:
        """Writes `values` to TensorBoard at the end of `update`."""
        if self._events is not None:
            scalars = [(f"finetune/{k}", float(v)) for k, v in values.items()]
            self._events.write(update * self.accumulation, scalars)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    def line(self, record: dict[str, float], now: float) -> str:
        """One line of the progress bar."""
        done = self.update / self.total
        width = 20
        filled = round(done * width)
        bar = "━" * filled + "─" * (width - filled)
        parts = [f"{self.update:>{len(str(self.total))}}/{self.total} {bar}"]
        parts.append(f"loss {record['loss']:.4f}" if "loss" in record else "")
        if "accuracy" in record:
            parts.append(f"accuracy {record['accuracy']:.3f}")
        parts.append(f"lr {record['learning_rate']:.2e}")
        if "loss_scale" in record:
            parts.append(f"scale {record['loss_scale']:g}")
        if "skipped_steps_total" in record:
            parts.append(f"skipped {record['skipped_steps_total']:g}")
        parts.append(f"{record['tokens_per_second']:,.0f} tokens/s")
        memory = f"memory {record['memory_gib']:.2f} GiB"
        if "tensors_mib" in record:
            memory += f" (tensors {record['tensors_mib']:,.1f} MiB)"
        parts.append(memory)
        rate = (now - self._began) / max(self.update - self._first, 1)
        parts.append(f"{rate * (self.total - self.update):.0f}s left")
        return " · ".join(p for p in parts if p)
