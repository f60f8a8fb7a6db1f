"""What kmp has applied to a model's layers: the policy it set on each layer
and why (so that a later `prepare` can tell kmp's settings from a user's
explicit `dtype=`), and the layers `OverflowHealer` moved. Weak: forgets
deleted layers."""

from __future__ import annotations

import dataclasses
import weakref
from typing import NamedTuple

import keras

from kmp.internals import keras_private
from kmp.precision import policy as policy_lib
from kmp.precision import quantization


# What kmp set on each layer, so that a later `prepare` can tell kmp's
# settings from a user's explicit `dtype=`. Weak: forgets deleted layers.
@dataclasses.dataclass(frozen=True)
class Applied:
    keras_name: str
    rule: str


applied_to: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Healed(NamedTuple):
    """A layer's move out of float16 by `kmp.callbacks.OverflowHealer`."""

    float_part: str  # the float policy it moved to
    text: str  # what happened
    ran: bool  # whether a training step ran with it


# Layers `kmp.callbacks.OverflowHealer` moved out of float16, {layer:
# Healed}: their policy is theirs (a later `prepare` keeps it, as a user's
# `dtype=`); the precision report says why it is so while the layer keeps
# that policy.
healed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_heal_writes = 0


def note_heal(layer, float_part: str, text: str, ran: bool = False) -> None:
    """Records (or updates) a layer's move in `healed`."""
    global _heal_writes
    healed[layer] = Healed(float_part, text, ran)
    _heal_writes += 1


def heal_writes() -> int:
    """How many times `note_heal` was called in this process: it grows with
    every move (a count of `healed` may not, as its layers are collected)."""
    return _heal_writes


def applied(layer: keras.layers.Layer) -> Applied | None:
    """What kmp last set on `layer` and why, if its policy is still that."""
    record = applied_to.get(layer)
    if record is not None and record.keras_name == quantization.float_part(layer):
        return record
    return None


def base_policy(model: keras.layers.Layer) -> policy_lib.Policy:
    """The policy `model` computes in: its own (kmp never changes a model's
    own policy)."""
    return policy_lib.get(quantization.float_policy(model))


def carry_over(old: keras.layers.Layer, new: keras.layers.Layer) -> None:
    """Gives `new`, a layer built from `old`'s config (a subclass's, in
    `kmp.layers.lean`), the policies kmp set on `old` and its sublayers,
    with kmp's records of them, sublayer by sublayer in Keras's order: a
    layer's config carries its own policy alone, so that a model rebuilt
    after `prepare` would otherwise take kmp's settings for the user's.

    Raises:
        ValueError: if the two layers' sublayers do not pair up.
    """
    olds = keras_private.sublayers(old, include_self=True)
    news = keras_private.sublayers(new, include_self=True)
    if [type(layer).__name__ for layer in olds[1:]] != [
        type(layer).__name__ for layer in news[1:]
    ]:
        raise ValueError(
            f"kmp cannot carry the policies it set on {old.path!r} over to its "
            f"replacement: their sublayers differ ({len(olds) - 1} against "
            f"{len(news) - 1}). Rebuild the model before kmp.prepare, "
            "kmp.compile or kmp.precision_report."
        )
    for before, after in zip(olds, news, strict=True):
        record = applied_to.get(before)
        if record is not None:
            after.dtype_policy = quantization.policy_of(before)
            applied_to[after] = record
