"""Layer names for messages: the layer class names kmp knows, and the
closest names to a word that matched nothing."""

from __future__ import annotations

import difflib
from typing import Any

import keras


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
