"""`InternalsChanged`: what an accessor of `kmp.internals` raises where the
installed Keras, KerasHub or TensorFlow no longer has what it reads."""

from __future__ import annotations


class InternalsChanged(RuntimeError):
    """The installed Keras, KerasHub or TensorFlow no longer has a private
    attribute kmp reads (kmp needs a release that supports this version)."""

    # Exception's own constructor: autograph re-raises the type unchanged.
    __init__ = Exception.__init__


def changed(
    library: str, version: str, what: str, consequence: str
) -> InternalsChanged:
    """The error for a private attribute `what` that `library` `version` no
    longer has, with what kmp cannot do without it."""
    return InternalsChanged(
        f"{library} {version} no longer has {what}, which kmp reads because no "
        f"public API gives it; without it {consequence}. Install the {library} "
        "version kmp supports (see kmp's pyproject.toml), or a kmp release "
        "that supports this one."
    )
