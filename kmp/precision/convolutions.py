"""How kmp computes convolutions under float16 on machines without GPUs or
TPUs: one process-wide mode (`kmp.rules.set_cpu_convolutions`), read by the
plan."""

from __future__ import annotations

CONVOLUTION_MODES = ("speed", "memory")


_mode = "speed"


def set_cpu_convolutions(mode: str) -> None:
    """Sets how kmp computes convolutions under float16 on a machine with no
    GPU or TPU, where TensorFlow's float16 convolutions are slow with and
    without native float16 math.

    * `'speed'` (default): convolutions compute in float32 where their
      consumers cast (they still return float16 to them). Their tensors the
      backward pass keeps are float32: about twice the memory of float16's.
    * `'memory'`: convolutions compute in float16, as Keras computes them:
      half that memory, for a training step many times slower.

    Either way rules set with `kmp.set_layer_policy` come first.
    `kmp.precision_report` says what `'speed'` costs a model.

    Args:
        mode: `'speed'` or `'memory'`.

    Raises:
        ValueError: for any other mode.

    Example:

    >>> kmp.rules.set_cpu_convolutions("memory")
    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> model = kmp.prepare(keras.Sequential([
    ...     keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="conv"),
    ...     keras.layers.Flatten(), keras.layers.Dense(1)]))
    >>> model.get_layer("conv").compute_dtype
    'float16'
    >>> kmp.rules.set_cpu_convolutions("speed")  # the default
    """
    global _mode
    if mode not in CONVOLUTION_MODES:
        raise ValueError(
            f"Unknown CPU convolutions mode {mode!r}. Expected 'speed' "
            "(float32 convolutions under float16 on machines without GPUs: "
            "fast, twice the memory of what they keep) or 'memory' (float16, "
            "as Keras computes them: slow on CPUs)."
        )
    _mode = mode


def cpu_convolutions() -> str:
    """The CPU convolutions mode in force (`'speed'` or `'memory'`)."""
    return _mode
