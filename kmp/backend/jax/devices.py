"""The accelerators JAX sees, for `kmp.hardware` and the policy `'auto'`
on Keras's JAX backend (TensorFlow's list says nothing of JAX's devices)."""

from __future__ import annotations


def _devices(platform: str) -> list:
    import jax  # the JAX edge: imported only where Keras runs JAX

    try:
        return jax.devices(platform)
    except RuntimeError:  # no such backend on this machine
        return []


def gpu_compute_capabilities() -> list[tuple[str, tuple[int, int]]]:
    """Each visible GPU's name and compute capability (`(8, 0)`)."""
    found = []
    for device in _devices("gpu"):
        capability = getattr(device, "compute_capability", None)
        if capability is not None:
            major, minor = str(capability).split(".")[:2]
            found.append((device.device_kind, (int(major), int(minor))))
    return found


def tpu_count() -> int:
    """How many TPU cores JAX sees."""
    return len(_devices("tpu"))
