"""`kmp.callbacks.NonFiniteGuard`: training that has collapsed (steps
skipped in a row with the loss scale at its floor, or weights gone
non-finite) is detected at the step it happens, and stopped, raised or
warned about with its diagnosis (`kmp.diagnostics.collapse`)."""

from __future__ import annotations

import logging
import math
from typing import Any

import keras
import numpy as np

from kmp.diagnostics import collapse
from kmp.diagnostics.collapse import TrainingCollapsedError
from kmp.scaling import optimizer as optimizer_lib
from kmp.scaling import registry
from kmp.training import stall
from kmp.training import train_function

logger = logging.getLogger("kmp")


def _numpy(value: Any) -> Any:
    return keras.ops.convert_to_numpy(value).item()


def _largest(counter: Any) -> int:
    """Where `counter` saturates: its dtype's largest value (int64's, or
    int32's on JAX without x64)."""
    return int(np.iinfo(keras.backend.standardize_dtype(counter.dtype)).max)


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
      overflow). The backward search reads TensorFlow's tape: on JAX the
      record alone names the layers.

    Under a `kmp.LossScaleOptimizer` in mode `'none'` (bfloat16, float32: no
    scale to lower) it acts after `max_consecutive_skips` skipped steps in a
    row, with the same diagnosis. With another optimizer (which applies
    non-finite steps) it acts when the loss is non-finite and the weights
    have become inf/NaN.

    Put it after a `LossScaleMonitor` in the callbacks list so that the
    monitor records the last step before the guard stops the run.

    Without it, `fit` under `kmp.compile` still raises a
    `TrainingCollapsedError` after 10 such steps;
    a `fit` with a guard leaves that check to the guard.

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
        max_consecutive_skips: int = stall.STALLED_AFTER,
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

    def _watch(self, on: bool) -> None:
        """Has kmp's own check for a stalled run leave this `fit` to the
        guard (`on`), or take it back."""
        # It watches `model.optimizer` only: a model trained by several
        # optimizers (a GAN's) keeps kmp's check.
        function = self._kmp_train_function()
        if function is not None and optimizer_lib.of_model(self.model) is not None:
            function.watched_by(self if on else None)

    def _kmp_train_function(self) -> train_function.TrainFunction | None:
        """The model's train function where it is kmp's, else None."""
        function = getattr(self.model, "train_function", None)
        return function if isinstance(function, train_function.TrainFunction) else None

    def on_train_end(self, logs=None):
        self._watch(False)

    def on_train_begin(self, logs=None):
        self._watch(True)
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
        optimizers = registry.optimizers_of(self.model)
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
            and total < _largest(opt.skipped_steps_total)  # saturated: stops
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
            at_floor = scale <= np.float32(opt.config.min_scale)
        if not at_floor:
            return None
        loss_finite = stall.loss_finite(opt, (logs or {}).get("loss"))
        return "forward" if loss_finite is False else "gradient"

    def _weights_finite(self) -> bool:
        return all(
            bool(np.isfinite(keras.ops.convert_to_numpy(w)).all())
            for w in self.model.weights
        )

    def on_train_batch_begin(self, batch, logs=None):
        # Keeps kmp's own check with this guard for the coming call.
        function = self._kmp_train_function()
        if function is not None:
            function.renew_watch()

    def on_train_batch_end(self, batch, logs=None):
        if self.diagnosis is not None and self.on_collapse == "warn":
            return  # said once; no more per-step checks
        cause = self._collapsed(batch, logs)
        if cause is None:
            return
        self.diagnosis = collapse.diagnose(
            self.model,
            cause,
            self.max_consecutive_skips,
            self.probe,
            self.probe_targets,
        )
        if self.on_collapse == "raise":
            self._watch(False)
            raise self.diagnosis
        logger.warning("%s", self.diagnosis.report)
        if self.on_collapse == "stop":
            self.model.stop_training = True
