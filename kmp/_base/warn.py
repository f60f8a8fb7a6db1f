"""Warnings at the user's line: the first caller outside kmp (their
train_step or loop, or Keras's trainer inside `fit`), not kmp's own file;
inside a `tf.function`, the line of the user's source that autograph's
converted copy runs, not the copy's temporary file. `once` says whether
an object has said a thing already (an optimizer's warnings, each once)."""

from __future__ import annotations

import os
import sys
import warnings
import weakref

from kmp.internals import autograph

# kmp's package directory (this file is in kmp/_base/).
_KMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each object has said, for `once`; held weakly, so it dies with it.
_said: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def once(owner: object, key: str) -> bool:
    """True the first time it is called for `owner` and `key`, then False:
    for what kmp says once per object, such as an optimizer's warnings."""
    said = _said.get(owner)
    if said is None:
        said = _said[owner] = set()
    if key in said:
        return False
    said.add(key)
    return True


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
    where = (frame.f_code.co_filename, frame.f_lineno)
    if autograph.is_converted(frame):
        where = autograph.origin(frame) or _caller_of_the_function(frame)
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        *where,
        module=module_globals.get("__name__", "<string>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


def _caller_of_the_function(frame) -> tuple[str, int]:
    """Where autograph's source map cannot be read: the first frame above
    `frame` outside kmp, TensorFlow and converted code (the user's call of
    their `tf.function`), else (in a thread of TensorFlow's) `frame`'s own
    place."""
    caller = frame.f_back
    while caller is not None and (
        _inside_kmp(caller)
        or autograph.is_converted(caller)
        or caller.f_globals.get("__name__", "").startswith("tensorflow.")
    ):
        caller = caller.f_back
    # A replica's thread (tf.distribute) starts in `threading`: no user call.
    if caller is None or caller.f_globals.get("__name__") == "threading":
        return frame.f_code.co_filename, frame.f_lineno
    return caller.f_code.co_filename, caller.f_lineno
