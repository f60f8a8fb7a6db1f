"""Variables' values in the state that `fit`'s step returns on JAX.

Keras's JAX trainer keeps no variable up to date during `fit`: its jitted
step takes and returns the values of every variable, as
`(trainable, non_trainable, optimizer, metrics)` lists, and writes them
back at each epoch's end. What kmp reads after a step (the loss scale, the
skipped steps) it reads there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras


def reader(model: keras.Model, state: tuple) -> Callable[[list], list]:
    """A function from a list of `model`'s optimizer or metric variables to
    their values in `state`, as new arrays (None for a variable not there).

    Copied: the step donates its state to the next step, which frees those
    arrays, and the logs kmp reads them into live on in callbacks. One
    jitted copy for the list: JAX dispatches it without waiting for the
    step, where an eager copy of each would wait.
    """
    _, _, optimizer_values, metrics_values = state
    values = {}
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        values.update(zip(map(id, optimizer.variables), optimizer_values, strict=True))
    values.update(zip(map(id, model.metrics_variables), metrics_values, strict=True))

    def read(variables: list) -> list:
        found = [values.get(id(variable)) for variable in variables]
        copies = iter(_copy(*(value for value in found if value is not None)))
        return [None if value is None else next(copies) for value in found]

    return read


@functools.cache
def _copier() -> Callable:
    import jax  # the JAX edge: imported only where Keras runs JAX

    return jax.jit(lambda *arrays: [jax.numpy.copy(a) for a in arrays])


def _copy(*arrays: Any) -> list:
    return _copier()(*arrays) if arrays else []


def ready(values: list) -> bool:
    """Whether every array of `values` is computed (reading it would not
    wait for the device)."""
    return all(value.is_ready() for value in values)


def mapping(model: keras.Model, state: tuple) -> list[tuple]:
    """Pairs of `model`'s variables and their values in `state`, for a
    `keras.StatelessScope` (in `fit`, `evaluate` and `predict`, Keras has
    taken the values out of the variables themselves). `state` holds the
    lists each of those steps takes: trainable and non-trainable variables,
    then for `fit` the optimizer's, then for `fit` and `evaluate` the
    metrics'."""
    groups = [model.trainable_variables, model.non_trainable_variables]
    if len(state) == 4:
        groups.append(model.optimizer.variables)
    if len(state) >= 3:
        groups.append(model.metrics_variables)
    return [
        (variable, value)
        for variables, values in zip(groups, state, strict=True)
        for variable, value in zip(variables, values, strict=True)
    ]


def check_placement(model: keras.Model, state: tuple) -> None:
    """Raises where a `keras.distribution` is set and some of `model`'s
    variables, or its optimizer's, live on one device of its several:
    they were made before `set_distribution`, and JAX's error about it
    ("incompatible devices") names neither them nor the fix."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return
    devices = distribution.device_mesh.devices.size
    if devices < 2:
        return
    groups = {
        "model": [*state[0], *state[1]],
        "optimizer": state[2] if len(state) == 4 else [],
    }
    made_before = [
        name
        for name, values in groups.items()
        if any(len(value.sharding.device_set) == 1 for value in values)
    ]
    if made_before:
        raise ValueError(
            f"The variables of the {' and its '.join(made_before)} of "
            f"{model.name!r} live on one device, but the "
            f"{type(distribution).__name__} set with "
            f"keras.distribution.set_distribution spans {devices}: they were "
            "made before it was set. Set the distribution first, then build "
            "the model and compile it (kmp.compile), as Keras requires with "
            "or without kmp."
        )
