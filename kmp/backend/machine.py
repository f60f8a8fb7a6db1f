"""The machine probe: the CPU, GPUs (with compute capability) and TPUs this
process sees (through TensorFlow, or JAX on Keras's JAX backend), read
once, and the policy `'auto'` picks for them.

Probing only: functions here return data and never print.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os

import keras

from kmp.backend import live_tensors
from kmp.backend.jax import devices as jax_devices
from kmp.precision.auto import AutoChoice
from kmp.precision.auto import choose_policy

logger = logging.getLogger("kmp")

# CPU flags (as Linux names them in /proc/cpuinfo) that matter for 16-bit math.
CPU_FLAGS_OF_INTEREST = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
_CPUINFO = "/proc/cpuinfo"


def read_cpu_flags(path: str = _CPUINFO) -> frozenset[str]:
    """Returns the CPU feature flags the OS reports (empty if unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError as e:
        logger.debug("cannot read CPU flags from %s: %s", path, e)
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The 16-bit-relevant CPU flags of this machine, read once."""
    return read_cpu_flags() & frozenset(CPU_FLAGS_OF_INTEREST)


def _gpu_compute_capabilities() -> list[tuple[str, tuple[int, int]]]:
    if keras.backend.backend() == "jax":
        return jax_devices.gpu_compute_capabilities()
    import tensorflow as tf

    found = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        cc = details.get("compute_capability")
        if cc is not None:
            found.append((details.get("device_name", device.name), tuple(cc)))
    return found


def _tpu_count() -> int:
    if keras.backend.backend() == "jax":
        return jax_devices.tpu_count()
    import tensorflow as tf

    return len(tf.config.list_physical_devices("TPU"))


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    """A visible GPU and the 16-bit math its Tensor Cores support."""

    name: str
    compute_capability: tuple[int, int]

    @property
    def float16_tensor_cores(self) -> bool:
        return self.compute_capability >= (7, 0)

    @property
    def bfloat16_tensor_cores(self) -> bool:
        return self.compute_capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        return self.compute_capability >= (8, 0)


@dataclasses.dataclass(frozen=True)
class CPUInfo:
    """The CPU, and its 16-bit-relevant features as the OS reports them."""

    model: str
    cores: int
    flags: frozenset[str]

    @property
    def native_bfloat16(self) -> bool:
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    @property
    def native_float16(self) -> bool:
        return bool(self.flags & {"avx512_fp16", "amx_fp16"})


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Every visible device: the CPU, GPUs (with compute capability), TPUs."""

    cpu: CPUInfo
    gpus: tuple[GPUInfo, ...]
    tpus: int


def _cpu_model(path: str = _CPUINFO) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.cache
def capabilities() -> Capabilities:
    """Describes the devices of this machine (read once; frozen).

    Example:

    >>> caps = kmp.hardware.capabilities()
    >>> caps.cpu.cores >= 1
    True
    """
    return Capabilities(
        cpu=CPUInfo(_cpu_model(), os.cpu_count() or 1, cpu_flags()),
        gpus=tuple(GPUInfo(n, cc) for n, cc in _gpu_compute_capabilities()),
        tpus=_tpu_count(),
    )


def resolve_auto() -> AutoChoice:
    """Returns the policy `'auto'` picks on this machine and the reason.

    `KMP_POLICY` in the environment overrides the hardware rule.
    """
    override = os.environ.get("KMP_POLICY")
    if override and override != "auto":
        return AutoChoice(override, "Set by the KMP_POLICY environment variable.")
    caps = capabilities()
    return choose_policy(
        [(g.name, g.compute_capability) for g in caps.gpus],
        caps.cpu.flags,
        caps.tpus,
        backend=keras.backend.backend(),
    )


def find_devices() -> None:
    """Has the backend find its devices now: TensorFlow prints its start-up
    notices as it does. JAX finds them at their first use."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.list_physical_devices()


def tensorflow_version() -> str:
    """TensorFlow's version. On another Keras backend it is read from the
    installed `tensorflow` distribution, without importing it (a JAX user
    may have none): 'not installed' where there is none."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.__version__
    try:
        return importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def tensors_peak_mb(gpu_only: bool = False) -> float | None:
    """The peak of the backend's live tensors in this process so far, in
    MiB: on the first GPU where there is one, else in host memory (weights,
    optimizer state, gradients, activations, input batches; not the
    runtime's own code and caches). None where the backend keeps no count:
    JAX counts its arrays on GPUs and TPUs, not on CPUs. With `gpu_only`,
    None without a GPU."""
    if keras.backend.backend() == "jax":
        if gpu_only and not capabilities().gpus:
            return None
        return jax_devices.peak_memory_mb()
    import tensorflow as tf

    where = live_tensors.device()
    if gpu_only and where != "GPU:0":
        return None
    try:
        info = tf.config.experimental.get_memory_info(where)
    except (ValueError, RuntimeError):
        return None
    return info["peak"] / 2**20
