"""The `'auto'` rule: which policy a machine's devices call for, as a pure
function of what the probe (`kmp.backend.machine`) found."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """The policy `'auto'` resolves to on this machine, and why."""

    policy: str
    reason: str


def choose_policy(
    gpus: list[tuple[str, tuple[int, int]]],
    flags: frozenset[str],
    tpus: int = 0,
    backend: str = "tensorflow",
) -> AutoChoice:
    """The `'auto'` rule, as a pure function of what the machine has and
    which Keras backend runs.

    TPUs first, then GPUs (the weakest GPU decides), then the CPU. On a CPU,
    only TensorFlow's runs bfloat16 math faster than float32: XLA's CPU code
    under JAX ran every 16-bit policy slower, even with AMX (`kmp bench`).
    """
    if tpus:
        return AutoChoice(
            "mixed_bfloat16", "TPUs compute in bfloat16 natively; no loss scaling."
        )
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
    if backend != "tensorflow":
        return AutoChoice(
            "float32",
            f"No GPU or TPU, and on Keras's {backend} backend XLA's CPU code "
            "runs 16-bit math slower than float32, whatever the CPU has.",
        )
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
