"""How `kmp.LossScaleOptimizer` saves its own state in a `.keras` file: by
name, with the layout's version.

Keras saves an optimizer's variables by position, which restores them into
the wrong slots as soon as the variable list changes. kmp's state (the loss
scale, its counters, the overflow record) is saved under its names, with
`kmp_format`; a file without that key was written by position (an older
kmp) and is read that way, with a warning. Control values are never saved.
The inner optimizer's variables are saved once, by Keras, as it saves that
optimizer anywhere.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from kmp._base import warn as _warn

# The version of the saved state's layout.
SAVE_FORMAT = 2
FORMAT_KEY = "kmp_format"
SEPARATOR = "|"  # not "/", which HDF5 reads as a group path


def saved_variables(state: dict[str, Any]) -> dict[str, Any]:
    """file key -> variable, for the state variables `state` (name ->
    variable). A name that repeats is numbered."""
    saved: dict[str, Any] = {}
    for name, variable in state.items():
        key = f"kmp{SEPARATOR}{name}"
        n = 1
        while key in saved:
            n += 1
            key = f"kmp{SEPARATOR}{name}{SEPARATOR}{n}"
        saved[key] = variable
    return saved


class SavedState:
    """The variables of a `kmp.LossScaleOptimizer` that are state, by name:
    what it saves and restores. A plain object, which Keras's and
    TensorFlow's attribute tracking store as it is (the optimizer's
    `add_variable` tracks the variables themselves).

    Attributes:
        variables: Name -> variable, in the order they were added.
    """

    def __init__(self):
        self.variables: dict[str, Any] = {}

    def add(self, name: str, variable: Any) -> Any:
        """Adds `variable` under `name`; returns it."""
        self.variables[name] = variable
        return variable

    def save(self, store) -> None:
        """Writes the variables into `store` by name."""
        store[FORMAT_KEY] = np.asarray(SAVE_FORMAT)
        for key, variable in saved_variables(self.variables).items():
            store[key] = keras.ops.convert_to_numpy(variable)

    def load(self, optimizer: Any, by_position: list, store) -> None:
        """Restores the variables from `store`, by name. A file saved by
        position is read into `by_position` (the optimizer's variables in
        the order they were saved then)."""
        _load(optimizer, self.variables, by_position, store)


def _load(optimizer: Any, state: dict[str, Any], by_position: list, store) -> None:
    """Restores `state` from `store`, by name (see `SavedState.load`). A
    value of another shape than its variable's is not restored; whatever is
    not restored is named in one warning."""
    keys = set(store.keys())
    if FORMAT_KEY not in keys:
        _load_by_position(optimizer, by_position, store)
        return
    saved = saved_variables(state)
    found = {key: key for key in saved if key in keys}
    wrong_shape = []
    for key, variable in saved.items():
        if key not in found:
            continue
        value = store[found[key]]
        if tuple(value.shape) != tuple(variable.shape):
            wrong_shape.append(
                f"{key} (file {tuple(value.shape)}, optimizer {tuple(variable.shape)})"
            )
            continue
        variable.assign(value)
    missing = [k for k in saved if k not in found]
    unknown = sorted(keys - set(found.values()) - {FORMAT_KEY})
    if missing or unknown or wrong_shape:
        _warn.warn(
            f"kmp.LossScaleOptimizer {optimizer.name!r}: restored the optimizer "
            f"state by name; not in the file (kept at their initial values): "
            f"{', '.join(missing) or 'none'}; in the file but not in this "
            f"optimizer (ignored): {', '.join(unknown) or 'none'}; of "
            f"another shape (kept at their initial values): "
            f"{', '.join(wrong_shape) or 'none'}."
        )


def _load_by_position(optimizer: Any, variables: list, store) -> None:
    if len(store.keys()) != len(variables):
        _warn.warn(
            f"kmp.LossScaleOptimizer {optimizer.name!r}: the file holds "
            f"{len(store.keys())} optimizer variables saved by position (an "
            f"older kmp), this optimizer has {len(variables)}: the optimizer "
            "state is not restored."
        )
        return
    _warn.warn(
        f"kmp.LossScaleOptimizer {optimizer.name!r}: restoring optimizer state "
        "saved by position (an older kmp); save again to store it by name."
    )
    for i, variable in enumerate(variables):
        variable.assign(store[str(i)])
