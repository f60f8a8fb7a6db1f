"""Ctrl-C while `kmp finetune` trains: the run stops at the end of the batch
it is in.

Python raises `KeyboardInterrupt` wherever the main thread is when SIGINT
comes. On Keras's JAX backend that can be inside JAX's garbage-collection
callback, which prints the exception and drops it: the run goes on. So
while training, SIGINT only asks to stop, and `StopOnInterrupt` raises
`KeyboardInterrupt` at the next batch's end. A second Ctrl-C interrupts at
once, as Python does.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import keras


class StopOnInterrupt(keras.callbacks.Callback):
    """A callback that raises `KeyboardInterrupt` at the end of the first
    batch (of training or evaluation) after SIGINT came, within its `with`
    block. Outside the main thread, where no signal handler can be set, it
    changes nothing."""

    def __init__(self):
        super().__init__()
        self.asked = False
        self._previous: Any = None

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._ask)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _ask(self, signum: int, frame: Any) -> None:
        self.asked = True
        signal.signal(signal.SIGINT, self._previous)  # a second one, at once

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.asked:
            raise KeyboardInterrupt

    on_test_batch_end = on_train_batch_end
