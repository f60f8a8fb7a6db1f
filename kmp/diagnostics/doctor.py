"""`kmp.doctor()`: the machine, the policy `'auto'` picks and why, the
settings kmp applies in this process, and the known slow paths, as data
(`kmp doctor` on the command line prints it)."""

from __future__ import annotations

import dataclasses

import keras

from kmp.backend import fused
from kmp.backend import grappler
from kmp.backend import machine
from kmp.backend.grappler import REMAPPER_PROCESS_WIDE
from kmp.backend.grappler import RemapperSetting
from kmp.backend.jax import devices as jax_devices
from kmp.backend.machine import Capabilities
from kmp.precision.auto import AutoChoice


def fast_path(caps: Capabilities) -> str:
    """One line on the 16-bit math this machine has: what a speed-up over
    float32 can come from here, or why there is none.

    Example:

    >>> from kmp.backend.machine import Capabilities, CPUInfo
    >>> cpu = CPUInfo("some CPU", 2, frozenset())
    >>> print(kmp.diagnostics.doctor.fast_path(Capabilities(cpu, (), 0)))
    No fast 16-bit path: this CPU has no native bfloat16 or float16 math ...
    """
    if caps.tpus:
        return "Fast path: TPUs, whose matrix units compute in bfloat16."
    if caps.gpus:
        gpu = min(caps.gpus, key=lambda g: g.compute_capability)
        kinds = [
            name
            for name, has in (
                ("bfloat16", gpu.bfloat16_tensor_cores),
                ("float16", gpu.float16_tensor_cores),
            )
            if has
        ]
        if kinds:
            return (
                f"Fast path: the {' and '.join(kinds)} Tensor Cores of {gpu.name}; "
                "the speed-up is largest where matmuls and convolutions dominate "
                "the step."
            )
        return (
            f"No fast 16-bit path: {gpu.name} has no 16-bit Tensor Cores, so "
            "mixed precision saves memory here but little time."
        )
    flags = caps.cpu.flags
    if keras.backend.backend() != "tensorflow":
        return (
            f"No fast 16-bit path on Keras's {keras.backend.backend()} backend "
            "without GPUs or TPUs: XLA's CPU code runs bfloat16 and float16 "
            "slower than float32, even on CPUs with 16-bit math."
        )
    if "amx_bf16" in flags:
        line = (
            "Fast path: AMX-BF16 (bfloat16 matrix units) on this CPU: bfloat16 "
            "matmuls run several times faster than float32; the step's float32 "
            "parts (optimizer update, normalization, softmax, casts) do not"
        )
    elif "avx512_bf16" in flags:
        line = (
            "Fast path: AVX512-BF16 on this CPU (bfloat16 dot products, no "
            "matrix units): bfloat16 matmuls are faster than float32, by less "
            "than on CPUs with AMX"
        )
    elif caps.cpu.native_float16:
        line = "Fast path: native float16 math (AVX512-FP16) on this CPU"
    else:
        return (
            "No fast 16-bit path: this CPU has no native bfloat16 or float16 "
            "math (no AVX512-BF16, AMX-BF16 or AVX512-FP16), so 16-bit "
            "policies run emulated and float32 is the fast choice here."
        )
    if caps.cpu.native_bfloat16 and caps.cpu.native_float16:
        line += "; float16 math is native too (AVX512-FP16)"
    return line + "."


def machine_remapper_note(setting: RemapperSetting) -> str:
    """`kmp doctor`'s sentence on the remapper setting in force (for a
    machine where kmp switches it)."""
    if setting.set_by_kmp:
        now = (
            "kmp has turned grappler's remapper off in this process while a "
            "float16 policy is in force (its fused float16 MatMul+BiasAdd CPU "
            "kernel is very slow); it comes back when the policy changes."
        )
    elif setting.enabled:
        now = (
            "Grappler remapping is on in this process. On a machine without "
            "GPUs kmp turns it off while a float16 policy is in force (its "
            "fused float16 MatMul+BiasAdd CPU kernel is very slow) and back on "
            "for other policies."
        )
    else:
        return (
            "Grappler remapping is off in this process, set outside kmp "
            "(tf.config.optimizer.set_experimental_options); kmp leaves it so, "
            "for every model."
        )
    return (
        f"{now} {REMAPPER_PROCESS_WIDE} Train models of different policies in separate "
        "processes, or call kmp.set_policy with a model's policy (or kmp.compile "
        "it again) right before each of its fits."
    )


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """The machine, the policy `'auto'` picks and why, versions, warnings."""

    capabilities: Capabilities
    auto: AutoChoice
    versions: dict[str, str]
    warnings: tuple[str, ...]
    fused_update: str = ""  # the rule `fused_update=None` follows here
    remapper: RemapperSetting | None = None  # grappler's remapping, now

    def to_dict(self) -> dict:
        caps = self.capabilities
        return {
            "cpu": {
                "model": caps.cpu.model,
                "cores": caps.cpu.cores,
                "flags": sorted(caps.cpu.flags),
                "native_bfloat16": caps.cpu.native_bfloat16,
                "native_float16": caps.cpu.native_float16,
            },
            "gpus": [
                {
                    "name": g.name,
                    "compute_capability": list(g.compute_capability),
                    "float16_tensor_cores": g.float16_tensor_cores,
                    "bfloat16_tensor_cores": g.bfloat16_tensor_cores,
                    "tf32": g.tf32,
                }
                for g in caps.gpus
            ],
            "tpus": caps.tpus,
            "auto": {"policy": self.auto.policy, "reason": self.auto.reason},
            "versions": dict(self.versions),
            "warnings": list(self.warnings),
            "fused_update": self.fused_update,
            "remapper": (
                dataclasses.asdict(self.remapper) if self.remapper is not None else None
            ),
        }


def known_slow_paths(caps: Capabilities) -> tuple[str, ...]:
    """Warnings for this hardware, from what was measured on such machines
    (`doctor` adds the settings in force in this process)."""
    warnings = []
    if not caps.gpus and not caps.tpus:
        warnings.append(
            "Training on the CPU: under float16, kmp computes convolutions in "
            "float32 (float16 CPU convolutions are several times slower than "
            "float32)."
        )
        if not caps.cpu.native_bfloat16:
            warnings.append(
                "This CPU has no native bfloat16 math (AVX512-BF16/AMX-BF16): "
                "16-bit policies are emulated here and slower than float32. "
                "Use 'float32' (what 'auto' picks)."
            )
        if not caps.cpu.native_float16:
            warnings.append(
                "This CPU has no native float16 math (AVX512-FP16/AMX-FP16): "
                "expect 'mixed_float16' to train slower than float32 "
                "(`kmp bench` measures it here). Use 'mixed_bfloat16' if the CPU "
                "has bfloat16 math, else 'float32'."
            )
    for gpu in caps.gpus:
        if gpu.float16_tensor_cores and not gpu.bfloat16_tensor_cores:
            warnings.append(
                f"{gpu.name} (compute capability {gpu.compute_capability[0]}."
                f"{gpu.compute_capability[1]}) has float16 but not bfloat16 "
                "Tensor Cores: 'mixed_bfloat16' runs slowly there; use "
                "'mixed_float16' (with loss scaling, as kmp.compile sets up)."
            )
        if not gpu.float16_tensor_cores:
            warnings.append(
                f"{gpu.name} has no Tensor Cores: mixed precision saves memory "
                "there but will not be faster."
            )
    return tuple(warnings)


def doctor() -> DoctorReport:
    """Probes the machine and returns a `DoctorReport` (prints nothing).

    Example:

    >>> report = kmp.doctor()
    >>> report.auto.policy in ("float32", "mixed_float16", "mixed_bfloat16")
    True
    """
    from kmp.version import __version__

    caps = machine.capabilities()
    auto = machine.resolve_auto()
    remapper = grappler.remapper_setting()
    notes = known_slow_paths(caps)
    if remapper.managed:
        notes = (machine_remapper_note(remapper), *notes)
    if auto.policy == "mixed_float16":
        notes += (QUANTIZED_FLOAT16_NOTE,)
    return DoctorReport(
        capabilities=caps,
        auto=auto,
        versions={
            "kmp": __version__,
            "tensorflow": machine.tensorflow_version(),
            "keras": keras.__version__,
            "keras backend": keras.backend.backend(),
            **(
                {"jax": jax_devices.version()}
                if keras.backend.backend() == "jax"
                else {}
            ),
        },
        warnings=notes,
        fused_update=fused.rule(),
        remapper=remapper,
    )


# Said where 'auto' picks float16: Keras refuses one quantization there.
QUANTIZED_FLOAT16_NOTE = (
    "Quantized models under 'mixed_float16': Keras refuses model.quantize('int8') "
    "under a float16 policy (int8 layers' int32 sums overflow float16). "
    "Quantize to 'int4' or 'float8' instead, or train an int8 model under "
    "'mixed_bfloat16' where the hardware has it (kmp keeps int8 layers out of "
    "float16 in any model it compiles)."
)
