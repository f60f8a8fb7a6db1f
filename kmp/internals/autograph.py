"""The private part of TensorFlow's autograph that kmp reads: the line of
the user's source that a frame of autograph's converted code stands for.

Inside a `tf.function`, autograph runs a converted copy of the user's
Python function from a temporary file (`__autograph_generated_file*.py`),
with the globals of the user's module; a warning issued for that frame
would name the temporary file. autograph keeps a source map on the
converted function (`ag_source_map`, which its own error messages read)
and calls that function from `converted_call`, whose frame holds it as
`converted_f`. Where either is missing, `origin` returns None and the
caller names another user frame; `tests/test_internals.py` fails then.

Nothing here imports TensorFlow: it reads frames and attributes only.
"""

from __future__ import annotations

import os
from types import FrameType

# How autograph names the temporary files of converted code.
GENERATED_PREFIX = "__autograph_generated_file"


def is_converted(frame: FrameType) -> bool:
    """Whether `frame` runs autograph's converted code."""
    return os.path.basename(frame.f_code.co_filename).startswith(GENERATED_PREFIX)


def origin(frame: FrameType) -> tuple[str, int] | None:
    """The user's `(filename, line)` that the converted code running in
    `frame` was made from, or None where it cannot be read.

    The source map is the converted function's, which autograph called from
    `converted_call`; it covers the whole temporary file, so the bodies of
    loops and branches, nested functions and lambdas (functions autograph
    calls from the converted one, in that file) are found through it too.
    """
    filename = frame.f_code.co_filename
    caller = frame.f_back
    while caller is not None:
        converted = caller.f_locals.get("converted_f")
        code = getattr(converted, "__code__", None)
        if getattr(code, "co_filename", None) == filename:
            return _mapped(getattr(converted, "ag_source_map", None), frame)
        caller = caller.f_back
    return None


def _mapped(source_map: object, frame: FrameType) -> tuple[str, int] | None:
    if not isinstance(source_map, dict):
        return None
    # Its keys are (filename, line) named tuples, equal to plain tuples.
    info = source_map.get((frame.f_code.co_filename, frame.f_lineno))
    location = getattr(info, "loc", None)
    filename = getattr(location, "filename", None)
    line = getattr(location, "lineno", None)
    if not isinstance(filename, str) or not isinstance(line, int):
        return None
    return filename, line
