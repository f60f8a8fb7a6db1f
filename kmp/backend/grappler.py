"""The grappler switch: kmp's float16 CPU fast path (grappler's remapper
off while a float16 policy is in force, on a machine without GPUs or TPUs),
and the setting in force now."""

from __future__ import annotations

import dataclasses
import logging

import keras

from kmp.backend import machine
from kmp.backend.machine import Capabilities

logger = logging.getLogger("kmp")


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

    >>> setting = kmp.backend.grappler.remapper_setting()
    >>> setting.enabled  # TensorFlow's default, under the float32 policy
    True

    On another Keras backend, grappler does not run: kmp manages nothing.
    """
    if keras.backend.backend() != "tensorflow":
        return RemapperSetting(enabled=False, managed=False, set_by_kmp=False)
    import tensorflow as tf

    caps = machine.capabilities()
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
        A description of each setting changed (empty if none; always empty
        on a Keras backend other than TensorFlow, where grappler does not
        run).
    """
    if keras.backend.backend() != "tensorflow":
        return ()
    import tensorflow as tf

    wanted = remapper_off_for(compute_dtype, machine.capabilities())
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
