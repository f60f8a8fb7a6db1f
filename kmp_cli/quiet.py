"""TensorFlow's start-up, without its C++ start-up notices.

Importing TensorFlow prints notices from its C++ runtime on standard error
before any setting can silence them (`TF_CPP_MIN_LOG_LEVEL` does not reach
them): that oneDNN is on, that no CUDA driver was found, which CPU
instructions the binary could use, and on a machine without an NVIDIA GPU
`E0000 ... failed call to cuInit: ... CUDA error`, which reads like a
failure although nothing failed (as does `E0000 ... oneDNN supports
DT_HALF only on platforms with AVX-512`, printed later, at the first
float16 op on a CPU oneDNN has no float16 kernels for). `start_tensorflow`
imports Keras, and under its TensorFlow backend lists the devices (when the
runtime starts), with standard error passed through a filter that writes
back every line that is not one of those notices: warnings, errors and
anything unexpected still show. By default only the start-up is filtered; a
measured run's own process keeps the filter until it exits
(`for_life=True`), since TensorFlow may probe a device platform again
later. Nothing else changes (no logging level is set).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import BinaryIO
from typing import TextIO

# absl's line prefix: severity, date, time, thread id, file:line.
_PREFIX = re.compile(r"^[IWEF]\d{4} \d+:\d+:\d+(\.\d+)?\s+\d+ [\w.\-]+:\d+\] ")

# Start-up notices, by the start of their message.
_NOTICES = (
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "TF-TRT Warning: Could not find TensorRT",
    # Printed at the first float16 op on a CPU without float16 kernels in
    # oneDNN; the op runs on Eigen's (`kmp doctor` says what that costs).
    "oneDNN supports DT_HALF only on platforms with AVX-512",
)
# Lines without the prefix that belong to the notices.
_PLAIN = (
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "To enable the following instructions:",
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
)
# Only a notice where no NVIDIA GPU can be reached: with one, it is a real error.
_NO_DRIVER_NOTICES = (
    "failed call to cuInit",
    "kernel driver does not appear to be running on this host",
    "retrieving CUDA diagnostic information for host",
    "hostname:",
)


def _has_nvidia_driver() -> bool:
    """Whether an NVIDIA GPU can be reached: the kernel driver is loaded and a
    device node exists. A container sees the host's driver in /proc without
    the device nodes when no GPU was passed to it; CUDA then fails to start,
    as it does with no driver at all."""
    if not os.path.exists("/proc/driver/nvidia/version"):
        return False
    return os.path.exists("/dev/nvidiactl") or any(
        re.fullmatch(r"nvidia\d+", name) for name in _listdir("/dev")
    )


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def is_startup_notice(line: str, nvidia_driver: bool) -> bool:
    """Whether `line` is one of TensorFlow's start-up notices (see above)."""
    if line.startswith(_PLAIN):
        return True
    match = _PREFIX.match(line)
    if not match:
        return False
    message = line[match.end() :]
    if message.startswith(_NOTICES):
        return True
    return not nvidia_driver and message.startswith(_NO_DRIVER_NOTICES)


class _Filter:
    """Standard error (the file descriptor, which C++ writes to) sent through
    a small Python process (this file run as a script) that writes back
    every line that is not a start-up notice as it arrives. Being another
    process, it outlives an abort of this one, so a fatal message still
    shows."""

    def __init__(self):
        self._saved = None
        self._sieve = None

    def start(self) -> bool:
        """Starts filtering; False where standard error cannot be redirected."""
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:
            return False
        try:
            sieve = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=saved,
            )
        except OSError:
            os.close(saved)
            return False
        os.dup2(sieve.stdin.fileno(), 2)
        self._saved, self._sieve = saved, sieve
        return True

    def stop(self) -> None:
        """Gives standard error back and waits until the filter has written
        everything out."""
        if self._sieve is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._sieve.stdin.close()
        self._sieve.wait()
        self._saved = self._sieve = None


@contextlib.contextmanager
def startup_notices_filtered() -> Iterator[None]:
    """Filters standard error (see `_Filter`) for the duration of the block.
    Where standard error cannot be redirected, the block runs unfiltered."""
    active = _Filter()
    active.start()
    try:
        yield
    finally:
        active.stop()


def _sieve(source: BinaryIO, sink: TextIO) -> None:
    """Copies `source` to `sink` line by line, leaving out start-up notices."""
    nvidia_driver = _has_nvidia_driver()
    for raw in source:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if not is_startup_notice(line, nvidia_driver):
            sink.write(line + "\n")
            sink.flush()


def start_tensorflow(for_life: bool = False) -> None:
    """Imports Keras, and with its TensorFlow backend starts TensorFlow's
    runtime, printing no start-up notices (see the module's docstring). Once
    per process: later calls return at once.

    Args:
        for_life: Keep filtering standard error until the process exits (a
            child process whose output is another process's progress),
            instead of only during the start-up.
    """
    if "keras" in sys.modules:
        return
    active = _Filter()
    if for_life and active.start():
        # Give standard error back at exit, once the filter has written out.
        atexit.register(active.stop)
        _import_and_list_devices()
        return
    with startup_notices_filtered():
        _import_and_list_devices()


def _import_and_list_devices() -> None:
    from kmp.backend import machine

    machine.find_devices()


if __name__ == "__main__":
    _sieve(sys.stdin.buffer, sys.stderr)
