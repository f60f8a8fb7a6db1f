"""What the machine can do, which policy `'auto'` picks for it, and the
known slow paths (`kmp.doctor()`).

Probing only: functions here return data and never print; `kmp doctor` on
the command line prints it.
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


def _tpu_count() -> int:
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


def choose_policy(
    gpus: list[tuple[str, tuple[int, int]]], flags: frozenset[str], tpus: int = 0
) -> AutoChoice:
    """The `'auto'` rule, as a pure function of what the machine has.

    TPUs first, then GPUs (the weakest GPU decides), then the CPU.
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


def fast_path(caps: Capabilities) -> str:
    """One line on the 16-bit math this machine has: what a speed-up over
    float32 can come from here, or why there is none.

    Example:

    >>> cpu = kmp.hardware.CPUInfo("some CPU", 2, frozenset())
    >>> print(kmp.hardware.fast_path(kmp.hardware.Capabilities(cpu, (), 0)))
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


# The grappler `remapping` option as it was before kmp turned it off, or None
# while kmp has not changed it.
_remapping_before_kmp: list[bool] = []
# The compute dtype of the last `apply_fast_paths` call (the last
# kmp.set_policy, policy_scope or kmp.compile), once there was one.
_last_decided_by: list[str] = []


@dataclasses.dataclass(frozen=True)
class RemapperSetting:
    """Grappler's `remapping` option as it is now, and what kmp did to it.

    The option is one setting for the whole process, and TensorFlow reads it
    at every call of a compiled function: a train function that has already
    run follows a later change at its next call (measured: a float16 `fit`
    traced with the remapper off became ~200x slower on an Intel Xeon once
    another model's compile turned it back on). kmp cannot set it per model.

    Attributes:
        enabled: The setting in force now (TensorFlow's default is on).
        managed: Whether kmp switches it on this machine (no GPUs, no TPUs):
            off while a float16 policy is in force.
        set_by_kmp: Whether kmp turned it off, and it is off because of that.
        decided_by: The compute dtype of the last `kmp.set_policy`,
            `kmp.policy_scope` or `kmp.compile` that applied kmp's rule;
            `''` while none did.
    """

    enabled: bool
    managed: bool
    set_by_kmp: bool
    decided_by: str = ""


def remapper_off_for(compute_dtype: str, caps: Capabilities) -> bool:
    """kmp's rule: whether grappler's remapper should be off for a compute
    dtype on a machine (float16 without GPUs or TPUs)."""
    return compute_dtype == "float16" and not caps.gpus and not caps.tpus


def remapper_setting() -> RemapperSetting:
    """Reads grappler's `remapping` setting now in force (see
    `RemapperSetting`; prints nothing, changes nothing).

    Example:

    >>> setting = kmp.hardware.remapper_setting()
    >>> setting.enabled  # TensorFlow's default, under the float32 policy
    True
    """
    import tensorflow as tf

    caps = capabilities()
    enabled = tf.config.optimizer.get_experimental_options().get("remapping", True)
    return RemapperSetting(
        enabled=bool(enabled),
        managed=not caps.gpus and not caps.tpus,
        set_by_kmp=bool(_remapping_before_kmp and _remapping_before_kmp[-1])
        and not enabled,
        decided_by=_last_decided_by[-1] if _last_decided_by else "",
    )


REMAPPER_PROCESS_WIDE = (
    "The setting is process-wide and TensorFlow reads it at every train-step "
    "call: the last kmp.set_policy, kmp.policy_scope or kmp.compile decides it "
    "for every model, so a model compiled after another under a different "
    "policy changes it for both, also for a model that has already trained."
)


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


def apply_fast_paths(compute_dtype: str) -> tuple[str, ...]:
    """Applies (or undoes) kmp's CPU fast-path settings for a compute dtype.

    On a machine without GPUs or TPUs, a float16 policy turns off grappler's
    remapper, whose fused float16 MatMul+BiasAdd CPU kernel was measured at
    ~0.1 GFLOP/s on Intel machines, and only while a float16
    policy is in force: bfloat16 keeps its fused kernels, and the previous
    setting comes back when the policy changes. `kmp.set_policy`,
    `kmp.policy_scope` and `kmp.compile` call this.

    The setting is process-wide (`RemapperSetting`): the last call decides
    it for every model in the process. `kmp.precision_report` and
    `kmp doctor` say so where it matters.

    Returns:
        A description of each setting changed (empty if none).
    """
    import tensorflow as tf

    wanted = remapper_off_for(compute_dtype, capabilities())
    _last_decided_by[:] = [compute_dtype]
    changed = []
    if wanted and not _remapping_before_kmp:
        before = tf.config.optimizer.get_experimental_options().get("remapping", True)
        _remapping_before_kmp.append(before)
        if before:
            tf.config.optimizer.set_experimental_options({"remapping": False})
            changed.append("grappler remapping off (float16 on a CPU)")
    elif not wanted and _remapping_before_kmp:
        before = _remapping_before_kmp.pop()
        tf.config.optimizer.set_experimental_options({"remapping": before})
        changed.append(f"grappler remapping restored to {before}")
    for change in changed:
        logger.info("kmp: %s", change)
    return tuple(changed)


def fast_paths_active() -> bool:
    """Whether kmp's float16 CPU fast path (remapper off) is in force."""
    return bool(_remapping_before_kmp)


def resolve_auto() -> AutoChoice:
    """Returns the policy `'auto'` picks on this machine and the reason.

    `KMP_POLICY` in the environment overrides the hardware rule.
    """
    override = os.environ.get("KMP_POLICY")
    if override and override != "auto":
        return AutoChoice(override, "Set by the KMP_POLICY environment variable.")
    caps = capabilities()
    return choose_policy(
        [(g.name, g.compute_capability) for g in caps.gpus], caps.cpu.flags, caps.tpus
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
    >>> report.auto.policy in kmp.list_policies()
    True
    """
    import keras
    import tensorflow as tf

    from kmp import fused
    from kmp.version import __version__

    caps = capabilities()
    auto = resolve_auto()
    remapper = remapper_setting()
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
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
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
