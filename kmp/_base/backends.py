"""Which of Keras's backends runs kmp, for the features that need one."""

from __future__ import annotations

import keras


def require_tensorflow(what: str, instead: str) -> None:
    """Raises `NotImplementedError` where Keras runs a backend other than
    TensorFlow: `what` needs TensorFlow, `instead` says what to do."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise NotImplementedError(
            f"{what} needs Keras's TensorFlow backend, and this process runs "
            f"its {backend} backend. {instead}"
        )
