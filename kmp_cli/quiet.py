"""TensorFlow's start-up, without its C++ start-up notices.

Importing TensorFlow prints notices from its C++ runtime on standard error
before any setting can silence them (`TF_CPP_MIN_LOG_LEVEL` does not reach
them): that oneDNN is on, that no CUDA driver was found, which CPU
instructions the binary could use, and on a machine without an NVIDIA
driver `E0000 ... failed call to cuInit: ... CUDA error`, which reads like a
failure although nothing failed. `start_tensorflow` imports TensorFlow and
Keras and lists the devices (when the runtime starts) with standard error
passed through a filter that writes back every line that is not one of
those notices: warnings, errors and anything unexpected still show. Only
the start-up is filtered; nothing else changes (no logging level is set).
"""

from __future__ import annotations

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
)
# Lines without the prefix that belong to the notices.
_PLAIN = (
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "To enable the following instructions:",
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
)
# Only a notice where no NVIDIA driver is loaded: with one, it is a real error.
_NO_DRIVER_NOTICES = (
    "failed call to cuInit",
    "kernel driver does not appear to be running on this host",
    "retrieving CUDA diagnostic information for host",
    "hostname:",
)


def _has_nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


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


@contextlib.contextmanager
def startup_notices_filtered() -> Iterator[None]:
    """Sends standard error (the file descriptor, which C++ writes to) through
    a filter for the duration of the block: a small Python process (this
    file run as a script) that writes back every line that is not a
    start-up notice as it arrives. Being another process, it outlives an
    abort of this one, so a fatal message still shows. Where standard error
    cannot be redirected, the block runs unfiltered."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        sieve = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=saved,
        )
    except OSError:
        os.close(saved)
        yield
        return
    os.dup2(sieve.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sieve.stdin.close()
        sieve.wait()


def _sieve(source: BinaryIO, sink: TextIO) -> None:
    """Copies `source` to `sink` line by line, leaving out start-up notices."""
    nvidia_driver = _has_nvidia_driver()
    for raw in source:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if not is_startup_notice(line, nvidia_driver):
            sink.write(line + "\n")
            sink.flush()


def start_tensorflow() -> None:
    """Imports TensorFlow and Keras and starts TensorFlow's runtime, printing
    no start-up notices (see the module's docstring). Once per process:
    later calls return at once."""
    if "tensorflow" in sys.modules:
        return
    with startup_notices_filtered():
        import keras  # noqa: F401
        import tensorflow as tf

        tf.config.list_physical_devices()


if __name__ == "__main__":
    _sieve(sys.stdin.buffer, sys.stderr)
