"""Measured training runs: a step timer, and running a function in a fresh
Python process (so that each run's memory, graphs and TensorFlow settings
are its own), and the peaks of its memory. Shared by `kmp bench`, `kmp
demo` and `kmp finetune`."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any


def step_timer(times: list[float], budget_s: float | None = None):
    """A Keras callback that appends each train step's wall time to `times`.

    With `budget_s`, training stops after the step that takes the total
    past it (after two steps at least: the first includes tracing)."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self._start)
            if budget_s is not None and len(times) >= 2 and sum(times) > budget_s:
                self.model.stop_training = True

    return StepTimer()


def in_fresh_process(
    function: str, args: list[Any], timeout: float, what: str, show_output: bool
) -> dict:
    """Calls `module:function(*args)` in a new Python process and returns
    the JSON-able dict it returned.

    With `show_output` the child's stderr (its progress) goes to ours;
    otherwise it is kept for the error message.

    Raises:
        RunFailed: if the child fails, naming `what` (a `RuntimeError`).
        subprocess.TimeoutExpired: if it runs past `timeout` (it is killed).
    """
    module, name = function.split(":")
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, module, name, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=None if show_output else subprocess.PIPE,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        detail = "see its output above" if show_output else result.stderr[-2000:]
        raise RunFailed(
            f"The {what} run failed in its process:\n{detail}",
            result.returncode,
            result.stderr or "",
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def process_peak_mb() -> float:
    """The peak resident memory of this process so far, in MiB (Linux's
    `ru_maxrss`, in KiB): TensorFlow's runtime included."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensors_peak_mb() -> float | None:
    """The peak of the live tensors in this process so far, in MiB
    (`kmp.backend.machine.tensors_peak_mb`)."""
    from kmp.backend import machine

    return machine.tensors_peak_mb()


class RunFailed(RuntimeError):
    """A run in a fresh process failed: its exit status (negative: the
    signal that killed it) and what it wrote to stderr (where kept)."""

    def __init__(self, message: str, returncode: int, stderr: str):
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr

    @property
    def out_of_memory(self) -> bool:
        """Whether it ran out of memory: killed by SIGKILL (the kernel's
        out-of-memory killer), TensorFlow's or Python's own error, or C++'s
        `std::bad_alloc`."""
        return self.returncode == -9 or any(
            name in self.stderr
            for name in ("ResourceExhaustedError", "MemoryError", "std::bad_alloc")
        )


def _child(module: str, name: str, args: str) -> None:
    function = getattr(importlib.import_module(module), name)
    print(json.dumps(function(*json.loads(args))))


# The child starts TensorFlow without its C++ start-up notices (kmp_cli.quiet)
# before anything imports it, and keeps them filtered until it exits.
_CHILD = (
    "import sys, kmp_cli; kmp_cli.start_tensorflow(for_life=True); "
    "import kmp.tools.runs as r; r._child(*sys.argv[1:])"
)
