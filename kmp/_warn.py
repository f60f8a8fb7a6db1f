"""Warnings at the user's line: the first caller outside kmp (their
train_step or loop, or Keras's trainer inside `fit`), not kmp's own file."""

from __future__ import annotations

import os
import sys
import warnings

_KMP_DIR = os.path.dirname(os.path.abspath(__file__))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` at the first caller outside kmp."""
    level = 2  # the caller of this function
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(
        os.path.abspath(frame.f_code.co_filename)
    ).startswith(_KMP_DIR):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
