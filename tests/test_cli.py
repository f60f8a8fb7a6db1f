import os
import re
import subprocess
import sys

import pytest

import kmp
import kmp_cli
from kmp_cli import quiet

# A line of TensorFlow's C++ logging (absl's prefix), or absl's own notice.
ABSL_LINE = re.compile(
    r"^([IWEF]\d{4} \d+:\d+:\S+\s+\d+ \S+:\d+\]|WARNING: All log)", re.M
)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python, with TensorFlow's log level left unset (as a
    user's shell has it) unless given."""
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=environ,
        check=False,
    )


def test_policies_command_prints_the_table_and_the_auto_choice(capsys):
    assert kmp_cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line}
    assert rows["mixed_float16"] == ["float16", "float32", "yes"]
    assert rows["mixed_bfloat16"] == ["bfloat16", "float32", "no"]
    assert "'auto' on this machine:" in out


def test_no_command_prints_help_and_fails(capsys):
    assert kmp_cli.main([]) == 2
    assert "usage: kmp" in capsys.readouterr().err


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as info:
        kmp_cli.main(["fly"])
    assert info.value.code == 2


def test_python_dash_m_kmp_reports_the_version():
    result = subprocess.run(
        [sys.executable, "-m", "kmp", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == f"kmp {kmp.__version__}"


def test_help_and_version_answer_without_importing_tensorflow():
    result = run_python(
        "import sys\n"
        "from kmp_cli import main\n"
        "for argv in (['--help'], ['bench', '--help'], ['demo', '--help'], "
        "['--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'kmp') if m in sys.modules))"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "[]"  # none of them imported
    assert f"kmp {kmp.__version__}" in lines


def test_bench_help_shows_each_default_and_what_policies_takes(capsys):
    with pytest.raises(SystemExit):
        kmp_cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--policies POLICIES comma-separated policy names" in out
    assert "(default: float32,mixed_bfloat16,mixed_float16)" in out
    assert "(default: 20)" in out and "(default: 64)" in out
    assert "(default: 120.0)" in out and "(default: mlp)" in out
    assert "(default: False)" not in out  # flags have no default to show


def test_commands_print_no_tensorflow_start_up_lines():
    # Unfiltered, TensorFlow prints its oneDNN, CUDA-driver and CPU-instruction
    # notices at start-up (and on machines without a driver a cuInit
    # "error"); test_start_up_filter_keeps_... holds such lines verbatim.
    result = run_python(
        "from kmp_cli import main\n"
        "assert main(['policies']) == 0\n"
        "assert main(['doctor']) == 0"
    )
    assert result.returncode == 0, result.stderr
    assert "'auto' on this machine:" in result.stdout and "kmp doctor" in result.stdout
    assert not ABSL_LINE.search(result.stderr + result.stdout), result.stderr
    assert "cuInit" not in result.stderr


def test_start_up_filter_keeps_what_is_not_a_start_up_notice():
    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are "
        "written to STDERR",
        "E0000 00:00:1796288028.028275    3866 util.cc:131] oneDNN supports "
        "DT_HALF only on platforms with AVX-512. Falling back to the default "
        "Eigen-based implementation if present.",
        "I0000 00:00:1796147400.017713   23938 port.cc:153] oneDNN custom "
        "operations are on. You may see slightly different numerical results",
        "I0000 00:00:1796147400.018189   23938 cudart_stub.cc:31] Could not find "
        "cuda drivers on your machine, GPU will not be used.",
        "E0000 00:00:1796146775.085241   22116 cuda_platform.cc:52] failed call to "
        "cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
        "W0000 00:00:1796146775.1   22116 bfc_allocator.cc:1] Allocator ran out "
        "of memory",
        "Traceback (most recent call last):",
    ]

    def kept(nvidia_driver):
        return [x for x in lines if not quiet.is_startup_notice(x, nvidia_driver)]

    assert kept(nvidia_driver=False) == lines[5:]
    # With an NVIDIA driver loaded, a failing cuInit is a real error: kept.
    assert kept(nvidia_driver=True) == lines[4:]


def test_a_driver_without_device_nodes_is_no_reachable_gpu(monkeypatch):
    # A container sees the host's /proc/driver/nvidia without any GPU's
    # device nodes: CUDA fails to start there as it does with no driver.
    present = {"/proc/driver/nvidia/version"}
    monkeypatch.setattr(quiet.os.path, "exists", lambda path: path in present)
    monkeypatch.setattr(quiet, "_listdir", lambda path: ["null", "tty0"])
    assert not quiet._has_nvidia_driver()
    monkeypatch.setattr(quiet, "_listdir", lambda path: ["null", "nvidia0"])
    assert quiet._has_nvidia_driver()
    present.clear()
    assert not quiet._has_nvidia_driver()


def test_a_run_process_keeps_filtering_after_its_start_up(capfd, monkeypatch):
    # A measured run (kmp demo's, whose standard error is the user's
    # terminal for its progress) starts TensorFlow without its notices and
    # keeps filtering until it exits: TensorFlow may probe a device platform
    # after the start-up. The run goes through the demo's own call.
    from kmp.tools import runs

    # As from a user's shell, where the variable is unset (the suite sets
    # it): the run's process gets the level kmp gives it, not the suite's.
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    notice = (
        "E0000 00:00:1.5  7 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL: CUDA error: UNKNOWN ERROR (303)"
    )
    command = f"echo '{notice}' >&2; echo 'still shown' >&2"
    assert runs.in_fresh_process("os:system", [command], 300, "a run", True) == 0
    err = capfd.readouterr().err
    assert err.endswith("still shown\n"), err
    kept = [line for line in err.splitlines() if ABSL_LINE.search(line)]
    assert kept == ([notice] if quiet._has_nvidia_driver() else []), err


def test_start_up_filter_writes_back_what_it_keeps_when_the_block_raises(capfd):
    with pytest.raises(ImportError), quiet.startup_notices_filtered():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is "
                 b"called are written to STDERR\nreal trouble\n")  # fmt: skip
        raise ImportError("no tensorflow")
    assert capfd.readouterr().err == "real trouble\n"


def test_a_fatal_message_during_start_up_still_shows_when_the_process_aborts():
    result = run_python(
        "import os\n"
        "from kmp_cli import quiet\n"
        "with quiet.startup_notices_filtered():\n"
        "    os.write(2, b'oneDNN is not a notice without its prefix\\n')\n"
        "    os.write(2, b'F0000 00:00:1.5  7 cpu_feature_guard.cc:1] needs AVX\\n')\n"
        "    os.abort()\n"
    )
    assert result.returncode != 0  # aborted
    assert "needs AVX" in result.stderr and "oneDNN is not" in result.stderr
