import json
import re

import pytest

import kmp
import kmp_cli
from kmp.backend import grappler
from kmp.backend import machine
from kmp.diagnostics import doctor as doctor_lib
from kmp.precision import auto
from kmp.precision import policy as policy_lib


def caps(flags=(), gpus=(), tpus=0):
    return machine.Capabilities(
        cpu=machine.CPUInfo("test cpu", 2, frozenset(flags)),
        gpus=tuple(machine.GPUInfo(n, cc) for n, cc in gpus),
        tpus=tpus,
    )


def test_capabilities_describe_this_machine():
    c = kmp.hardware.capabilities()
    assert c.cpu.cores >= 1 and c.cpu.model
    assert c.cpu.flags <= set(machine.CPU_FLAGS_OF_INTEREST)
    assert c is kmp.hardware.capabilities()  # probed once


def test_capabilities_keep_the_os_flags_that_matter_for_16_bit_math(monkeypatch):
    # What the OS lists (read_cpu_flags: tested on a file in test_policy.py)
    # is narrowed to the flags of interest, and probed once.
    listed = frozenset({"sse", "avx2", "avx512f", "amx_bf16", "avx512_fp16"})
    monkeypatch.setattr(machine, "read_cpu_flags", lambda: listed)
    machine.cpu_flags.cache_clear()
    machine.capabilities.cache_clear()
    try:
        assert machine.capabilities().cpu.flags == {"amx_bf16", "avx512_fp16"}
        assert machine.capabilities().cpu.native_bfloat16
    finally:
        machine.cpu_flags.cache_clear()
        machine.capabilities.cache_clear()


@pytest.mark.parametrize(
    "cc, fp16, bf16, tf32",
    [
        ((6, 1), False, False, False),
        ((7, 5), True, False, False),
        ((8, 0), True, True, True),
        ((9, 0), True, True, True),
    ],
)
def test_gpu_tensor_core_support_follows_compute_capability(cc, fp16, bf16, tf32):
    gpu = machine.GPUInfo("g", cc)
    assert (gpu.float16_tensor_cores, gpu.bfloat16_tensor_cores, gpu.tf32) == (
        fp16,
        bf16,
        tf32,
    )


def test_auto_picks_bfloat16_on_tpus():
    assert auto.choose_policy([], frozenset(), tpus=8).policy == "mixed_bfloat16"


@pytest.mark.parametrize(
    "machine, expected",
    [
        (
            caps(),
            ["convolutions in float32", "no native bfloat16", "no native float16"],
        ),
        (caps({"avx512_bf16"}), ["convolutions in float32", "no native float16"]),
        (caps({"amx_bf16", "amx_fp16"}), ["convolutions in float32"]),
        (caps(gpus=[("T4", (7, 5))]), ["float16 but not bfloat16"]),
        (caps(gpus=[("A100", (8, 0))]), []),
        (caps(gpus=[("P100", (6, 0))]), ["no Tensor Cores"]),
    ],
)
def test_known_slow_paths(machine, expected):
    warnings = doctor_lib.known_slow_paths(machine)
    assert len(warnings) == len(expected)
    for warning, text in zip(warnings, expected, strict=True):
        assert text in warning


@pytest.mark.parametrize(
    "machine, expected",
    [
        (caps(), "No fast 16-bit path: this CPU has no native"),
        (caps({"avx512_bf16"}), "Fast path: AVX512-BF16 on this CPU (bfloat16 dot"),
        (
            caps({"amx_bf16", "avx512_bf16", "avx512_fp16"}),
            "Fast path: AMX-BF16 (bfloat16 matrix units)",
        ),
        (caps({"avx512_fp16"}), "Fast path: native float16 math (AVX512-FP16)"),
        (
            caps(gpus=[("A100", (8, 0))]),
            "the bfloat16 and float16 Tensor Cores of A100",
        ),
        (caps(gpus=[("P100", (6, 0))]), "No fast 16-bit path: P100 has no 16-bit"),
        (caps(tpus=8), "Fast path: TPUs"),
    ],
)
def test_fast_path_names_what_a_speed_up_comes_from(machine, expected):
    line = doctor_lib.fast_path(machine)
    assert expected in line
    assert "\n" not in line
    # float16 being native too is said only where it is.
    assert ("float16 math is native too" in line) == (
        machine.cpu.flags >= {"amx_bf16", "avx512_fp16"} and not machine.gpus
    )


@pytest.mark.parametrize(
    "fuses, said",
    [
        (True, "fused update: kmp fuses the float32 optimizer update with XLA"),
        (False, "fused update: The optimizer update is not fused by default here"),
    ],
)
def test_doctor_states_the_fused_update_rule(capsys, monkeypatch, fuses, said):
    from kmp.backend import fused

    monkeypatch.setattr(fused, "default_for_machine", lambda: fuses)
    assert kmp_cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert said in out
    if fuses:
        assert f"at least {fused.MIN_WEIGHTS:,} weights" in out


def test_doctor_returns_data_matching_the_auto_policy():
    report = kmp.doctor()
    # What doctor says 'auto' picks is what set_policy('auto') sets.
    assert report.auto.policy == kmp.set_policy("auto").name
    assert set(report.versions) == {"kmp", "tensorflow", "keras", "keras backend"}
    assert report.versions["keras backend"] == "tensorflow"
    data = report.to_dict()
    assert data["auto"]["policy"] == report.auto.policy
    json.dumps(data)  # serializable


def test_doctor_command_prints_devices_auto_and_versions(capsys):
    assert kmp_cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "device  name" in out and "CPU" in out
    picked = re.search(r"'auto' picks: (\S+)", out)
    assert picked and picked[1] in policy_lib.list_policies()
    assert "versions: kmp" in out


def test_doctor_command_json(capsys):
    assert kmp_cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpu"]["cores"] >= 1
    assert data["auto"]["policy"] in policy_lib.list_policies()


def remapping():
    import tensorflow as tf

    return tf.config.optimizer.get_experimental_options().get("remapping", True)


@pytest.mark.skipif(
    bool(machine.capabilities().gpus), reason="the fast path is for CPU-only machines"
)
def test_float16_on_a_cpu_turns_the_remapper_off_only_while_in_force():
    assert remapping() is True
    kmp.set_policy("mixed_float16")
    assert remapping() is False and grappler.fast_paths_active()
    assert any("remapper off" in w for w in kmp.doctor().warnings)
    kmp.set_policy("mixed_bfloat16")  # bfloat16 keeps its fused kernels
    assert remapping() is True and not grappler.fast_paths_active()
    with kmp.policy_scope("float16"):
        assert remapping() is False
    assert remapping() is True


@pytest.mark.skipif(
    bool(machine.capabilities().gpus), reason="the fast path is for CPU-only machines"
)
def test_a_users_own_remapper_setting_comes_back():
    import tensorflow as tf

    tf.config.optimizer.set_experimental_options({"remapping": False})
    try:
        kmp.set_policy("mixed_float16")
        kmp.set_policy("float32")
        assert remapping() is False  # the user's choice, kept
    finally:
        tf.config.optimizer.set_experimental_options({"remapping": True})


@pytest.mark.skipif(
    bool(machine.capabilities().gpus), reason="the fast path is for CPU-only machines"
)
def test_kmp_compile_applies_the_fast_path_of_the_model_it_compiles():
    import keras

    with kmp.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert remapping() is True  # the scope is over...
    kmp.compile(model, optimizer="sgd", loss="mse")
    assert remapping() is False  # ...but the model computes in float16
    float32_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    kmp.compile(float32_model, optimizer="sgd", loss="mse")
    assert remapping() is True


def test_doctor_says_what_to_quantize_to_where_auto_picks_float16(monkeypatch):
    monkeypatch.setenv("KMP_POLICY", "mixed_float16")
    notes = kmp.doctor().warnings
    assert any("model.quantize('int8')" in n and "'int4'" in n for n in notes)
    monkeypatch.setenv("KMP_POLICY", "mixed_bfloat16")
    assert not any("model.quantize" in n for n in kmp.doctor().warnings)


def test_doctor_states_the_process_wide_remapper_setting_on_a_cpu(capsys, monkeypatch):
    monkeypatch.setattr(machine, "capabilities", lambda: caps())
    kmp.set_policy("mixed_float16")
    assert kmp_cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "remapper off in this process while a float16 policy" in out
    assert "process-wide" in out and "changes it for both" in out
    assert "separate processes" in out
    assert kmp.doctor().to_dict()["remapper"] == {
        "enabled": False,
        "managed": True,
        "set_by_kmp": True,
        "decided_by": "float16",
    }
    kmp.set_policy("float32")
    (note,) = [w for w in kmp.doctor().warnings if "process-wide" in w]
    assert note.startswith("Grappler remapping is on in this process.")


def test_doctor_is_silent_on_the_remapper_where_kmp_never_switches_it(monkeypatch):
    monkeypatch.setattr(machine, "capabilities", lambda: caps(gpus=[("A100", (8, 0))]))
    kmp.set_policy("mixed_float16")
    report = kmp.doctor()
    assert report.remapper.enabled and not report.remapper.managed
    assert not any("remapp" in w for w in report.warnings)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(cell: str) -> float:
    """The size a memory cell shows ('644 B', '1.3 KiB (Adam)'), in bytes."""
    number, unit = cell.split()[:2]
    return float(number) * _UNITS[unit]


def _memory_row(out: str, policy: str) -> dict[str, str]:
    """The cells of `policy`'s row in `kmp doctor --model`'s memory table,
    by the first word of their column's header."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    header = re.split(r"\s{2,}", lines[at].strip())
    row = next(line for line in lines[at:] if line.startswith(f"{policy} "))
    cells = re.split(r"\s{2,}", row.strip())
    return {name.split()[0]: cell for name, cell in zip(header, cells, strict=True)}


@pytest.mark.parametrize(
    "inputs, width, weights, optimizer",
    [
        # 161 float32 weights: each figure is a few hundred bytes, under
        # the 0.05 MB that one decimal of MB shows as 0.0.
        (8, 16, "644 B", "1.3 KiB (Adam)"),
        # 1,050,625 float32 weights: 4.0 MiB, Adam's two moments 8.0 MiB.
        (1024, 1024, "4 MiB", "8 MiB (Adam)"),
    ],
)
def test_doctor_shows_a_models_memory_in_a_unit_that_keeps_small_figures(
    tmp_path, capsys, inputs, width, weights, optimizer
):
    import keras

    model = keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    path = str(tmp_path / "model.keras")
    model.save(path)
    argv = ["doctor", "--model", path, "--policies", "float32"]
    assert kmp_cli.main(argv) == 0
    out = capsys.readouterr().out
    if "memory estimate: not measured." in out:
        pytest.skip("TensorFlow counts no live tensors here (oneDNN off)")
    row = _memory_row(out, "float32")
    assert (row["weights"], row["optimizer"]) == (weights, optimizer)
    # The step holds at least the gradients it returns, one per weight,
    # also where the allocator's count misses small tensors (to the 5% that
    # one decimal rounds).
    gradients = 4 * model.count_params()
    assert _bytes(row["step"]) >= 0.95 * gradients, row
    held = sum(_bytes(row[column]) for column in ("weights", "optimizer", "step"))
    assert _bytes(row["total"]) >= 0.95 * held, row
    if not machine.capabilities().gpus:
        # A CPU's count misses tensors under 256 KiB: the output says so.
        assert "misses tensors under 256 KiB" in out


def test_doctor_runs_its_other_checks_where_tensorflow_counts_no_memory(
    tmp_path, capsys, monkeypatch
):
    # A CPU with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0) keeps no count of live
    # tensors: TensorFlow refuses to reset it, as here.
    import keras
    import tensorflow as tf

    def refuse(device):
        raise ValueError(f"Cannot reset memory stats for device '{device}'")

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    path = str(tmp_path / "model.keras")
    model.save(path)
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", refuse)
    argv = ["doctor", "--model", path, "--policies", "float32"]
    assert kmp_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "memory estimate: not measured." in out
    assert "TensorFlow said: Cannot reset memory stats" in out
    assert "activation range and precision of" in out  # the next check ran
    assert kmp_cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "Cannot reset memory stats" in data["memory_estimate"]["float32"]["error"]
    assert "activation_range" in data
