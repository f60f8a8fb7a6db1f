"""What the machine can do, and which policy `'auto'` picks for it.

Probing only: functions here return data and never print.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

logger = logging.getLogger("kmp")

# CPU flags (as Linux names them in /proc/cpuinfo) that matter for 16-bit math.
CPU_FLAGS_OF_INTEREST = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
_CPUINFO = "/proc/cpuinfo"


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """The policy `'auto'` resolves to on this machine, and why."""

    policy: str
    reason: str


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
    import tensorflow as tf

    found = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        cc = details.get("compute_capability")
        if cc is not None:
            found.append((details.get("device_name", device.name), tuple(cc)))
    return found


def choose_policy(
    gpus: list[tuple[str, tuple[int, int]]], flags: frozenset[str]
) -> AutoChoice:
    """The `'auto'` rule, as a pure function of what the machine has.

    GPUs win over the CPU when present; the weakest GPU decides.
    """
    if gpus:
        name, cc = min(gpus, key=lambda g: g[1])
        if cc >= (8, 0):
            return AutoChoice(
                "mixed_bfloat16",
                f"GPU {name} (compute capability {cc[0]}.{cc[1]}) has bfloat16 "
                "Tensor Cores; bfloat16 needs no loss scaling.",
            )
        if cc >= (7, 0):
            return AutoChoice(
                "mixed_float16",
                f"GPU {name} (compute capability {cc[0]}.{cc[1]}) has float16 "
                "Tensor Cores but no bfloat16 ones.",
            )
        return AutoChoice(
            "float32",
            f"GPU {name} (compute capability {cc[0]}.{cc[1]}) has no 16-bit "
            "Tensor Cores; mixed precision would not be faster.",
        )
    fast_bf16 = sorted(flags & {"amx_bf16", "avx512_bf16"})
    if fast_bf16:
        return AutoChoice(
            "mixed_bfloat16",
            f"CPU has native bfloat16 math ({', '.join(fast_bf16)}).",
        )
    return AutoChoice(
        "float32",
        "No GPU, and the CPU lacks AVX512-BF16/AMX-BF16: 16-bit math would be "
        "emulated and slower than float32.",
    )


def resolve_auto() -> AutoChoice:
    """Returns the policy `'auto'` picks on this machine and the reason.

    `KMP_POLICY` in the environment overrides the hardware rule.
    """
    override = os.environ.get("KMP_POLICY")
    if override and override != "auto":
        return AutoChoice(override, "Set by the KMP_POLICY environment variable.")
    return choose_policy(_gpu_compute_capabilities(), cpu_flags())
