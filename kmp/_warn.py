"""Warnings at the user's line: the first caller outside kmp (their
train_step or loop, or Keras's trainer inside `fit`), not kmp's own file."""

from __future__ import annotations

import os
import sys
import warnings

import tensorflow as tf

_KMP_DIR = os.path.dirname(os.path.abspath(__file__))


def _inside_kmp(frame) -> bool:
    # autograph runs converted copies of functions from temporary files,
    # with the globals of the module they come from
    name = frame.f_globals.get("__name__", "")
    if name.startswith(("kmp.", "tensorflow.python.autograph.")) or name == "kmp":
        return True  # kmp, or autograph calling a converted kmp function
    return os.path.dirname(os.path.abspath(frame.f_code.co_filename)).startswith(
        _KMP_DIR
    )


@tf.autograph.experimental.do_not_convert
def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` at the first caller outside kmp."""
    level = 2  # the caller of this function
    frame = sys._getframe(1)
    while frame is not None and _inside_kmp(frame):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
