"""Ctrl-C while `kmp finetune` trains: the run stops at the end of the batch
it is in.

Python raises `KeyboardInterrupt` wherever the main thread is when SIGINT
comes. On Keras's JAX backend that can be inside JAX's garbage-collection
callback, which prints the exception and drops it: the run goes on. So
while training, SIGINT only asks to stop, and `StopOnInterrupt` raises
`KeyboardInterrupt` at the next batch's end, or where its `with` block ends.
A second Ctrl-C goes to the handler there was before, as it would without
kmp.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import keras


class StopOnInterrupt(keras.callbacks.Callback):
    """A callback that raises `KeyboardInterrupt` at the end of the first
    batch (of training or evaluation) after SIGINT came within its `with`
    block, or at the block's end. It changes nothing outside the main
    thread, where no signal handler can be set, nor where SIGINT is
    ignored."""

    def __init__(self):
        super().__init__()
        self.asked = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = signal.getsignal(signal.SIGINT)
        if previous is signal.SIG_IGN:
            return self
        # None: a handler set from C, which Python cannot put back.
        self._previous = signal.SIG_DFL if previous is None else previous
        self._installed = True
        signal.signal(signal.SIGINT, self._ask)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        if self.asked and exc_type is None:
            raise KeyboardInterrupt  # it came after the last batch's end

    def _ask(self, signum: int, frame: Any) -> None:
        self.asked = True
        signal.signal(signal.SIGINT, self._previous)  # a second one: as before

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.asked:
            raise KeyboardInterrupt

    on_test_batch_end = on_train_batch_end
