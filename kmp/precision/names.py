"""Matching rules to the layers they name: the layer class names kmp knows,
the closest names to a selector that matched nothing, and the message that
says so."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING
from typing import Any

import keras

if TYPE_CHECKING:
    from kmp.precision.rules import LayerRule


def known_layer_class_names() -> set[str]:
    """The names of every `keras.layers.Layer` subclass defined so far:
    Keras's, those of libraries already imported, and the user's."""
    names: set[str] = set()
    pending = [keras.layers.Layer]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub.__name__ not in names:
                names.add(sub.__name__)
                pending.append(sub)
    return names


def closest(word: str, candidates: Any, n: int = 3) -> list[str]:
    """The candidates that come closest to `word` (case-insensitive)."""
    by_lower = {c.lower(): c for c in candidates}
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=0.6)
    return [by_lower[f] for f in found]


def unmatched_message(rule: LayerRule, candidates: Any, where: str) -> str:
    """Says that `rule` matches nothing in `where`, with the closest names."""
    pattern = rule.selector if isinstance(rule.selector, str) else ""
    near = closest(pattern.replace("*", "").replace("?", ""), candidates)
    hint = (
        f" Closest {'class names' if rule.kind == 'class' else 'names'}: "
        f"{', '.join(near)}."
        if near
        else ""
    )
    return f"kmp: {rule.describe()} matches no layer {where}.{hint}"
