"""Warnings at the user's line: the first caller outside kmp (their
train_step or loop, or Keras's trainer inside `fit`), not kmp's own file."""

from __future__ import annotations

import os
import sys
import warnings

# kmp's package directory (this file is in kmp/_base/).
_KMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inside_kmp(frame) -> bool:
    # autograph runs converted copies of functions from temporary files,
    # with the globals of the module they come from
    name = frame.f_globals.get("__name__", "")
    if name.startswith(("kmp.", "tensorflow.python.autograph.")) or name == "kmp":
        return True  # kmp, or autograph calling a converted kmp function
    directory = os.path.dirname(os.path.abspath(frame.f_code.co_filename))
    return directory == _KMP_DIR or directory.startswith(_KMP_DIR + os.sep)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` at the first caller outside kmp.

    The warning is issued for that caller's frame directly (as
    `warnings.warn` does for the frame its `stacklevel` names), so frames
    that TensorFlow's autograph adds between kmp's code and this call (where
    it converts kmp's functions while tracing) cannot shift it."""
    frame = sys._getframe(1)
    while frame is not None and _inside_kmp(frame):
        frame = frame.f_back
    if frame is None:  # called from kmp with no user code above (an import)
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )
