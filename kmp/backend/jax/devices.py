"""The accelerators JAX sees, for `kmp.hardware` and the policy `'auto'`
on Keras's JAX backend (TensorFlow's list says nothing of JAX's devices)."""

from __future__ import annotations


def _devices(platform: str | None) -> list:
    import jax  # the JAX edge: imported only where Keras runs JAX

    try:
        return jax.devices(platform)
    except RuntimeError:  # no such backend on this machine
        return []


def gpu_compute_capabilities() -> list[tuple[str, tuple[int, int]]]:
    """Each visible GPU's name and compute capability (`(8, 0)`)."""
    found = []
    for device in _devices("gpu"):
        capability = str(getattr(device, "compute_capability", ""))
        parts = capability.split(".")
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            # CUDA's "8.0"; ROCm's "gfx90a" is no compute capability.
            found.append((device.device_kind, (int(parts[0]), int(parts[1]))))
    return found


def tpu_count() -> int:
    """How many TPU cores JAX sees."""
    return len(_devices("tpu"))


def peak_memory_mb() -> float | None:
    """The peak of JAX's live arrays on its first device so far, in MiB.
    None where the device keeps no such count (JAX's CPU devices)."""
    devices = _devices(None)
    stats = devices[0].memory_stats() if devices else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


def version() -> str:
    """JAX's version."""
    import jax

    return jax.__version__


# What XLA's CPU code says of a float16 product summed in float32, which
# jax.numpy's einsum asks for (Keras's and KerasHub's attention use it).
_FLOAT16_SUMS = "'F16_F16_F32' is not supported by dot_general on CPU"


def refuses_float16_sums(error: BaseException) -> bool:
    """Whether `error` is XLA's CPU code refusing a float16 product summed
    in float32."""
    return isinstance(error, ValueError) and _FLOAT16_SUMS in str(error)
