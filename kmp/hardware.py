"""What the machine can do, which policy `'auto'` picks for it, kmp's float16
CPU fast path, and `kmp.doctor()`.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.backend.grappler import REMAPPER_PROCESS_WIDE
from kmp.backend.grappler import RemapperSetting
from kmp.backend.grappler import apply_fast_paths
from kmp.backend.grappler import fast_paths_active
from kmp.backend.grappler import remapper_off_for
from kmp.backend.grappler import remapper_setting
from kmp.backend.machine import CPU_FLAGS_OF_INTEREST
from kmp.backend.machine import Capabilities
from kmp.backend.machine import CPUInfo
from kmp.backend.machine import GPUInfo
from kmp.backend.machine import capabilities
from kmp.backend.machine import cpu_flags
from kmp.backend.machine import read_cpu_flags
from kmp.backend.machine import resolve_auto
from kmp.diagnostics.doctor import QUANTIZED_FLOAT16_NOTE
from kmp.diagnostics.doctor import DoctorReport
from kmp.diagnostics.doctor import doctor
from kmp.diagnostics.doctor import fast_path
from kmp.diagnostics.doctor import known_slow_paths
from kmp.diagnostics.doctor import machine_remapper_note
from kmp.precision.auto import AutoChoice
from kmp.precision.auto import choose_policy

__all__ = [
    "CPU_FLAGS_OF_INTEREST",
    "QUANTIZED_FLOAT16_NOTE",
    "REMAPPER_PROCESS_WIDE",
    "AutoChoice",
    "CPUInfo",
    "Capabilities",
    "DoctorReport",
    "GPUInfo",
    "RemapperSetting",
    "apply_fast_paths",
    "capabilities",
    "choose_policy",
    "cpu_flags",
    "doctor",
    "fast_path",
    "fast_paths_active",
    "known_slow_paths",
    "machine_remapper_note",
    "read_cpu_flags",
    "remapper_off_for",
    "remapper_setting",
    "resolve_auto",
]
