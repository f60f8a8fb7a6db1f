"""kmp installs into an existing environment as the README says: a wheel
built from the checkout, installed with pip into a fresh virtual
environment whose dependencies (TensorFlow, Keras, NumPy) are already
there, then imported and run from there, not from the checkout."""

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import kmp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, **kwargs):
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **kwargs,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.slow
def test_kmp_installs_into_a_fresh_virtual_environment(tmp_path):
    # A copy of the sources, so that no build/ left in the checkout (whose
    # build/lib may hold deleted modules) goes into the wheel.
    source = tmp_path / "source"
    skip = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*cache")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*skip))
    wheels = tmp_path / "wheels"
    # setuptools comes with the test extra, so the build needs no network.
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "-q", "-w", wheels, source)  # fmt: skip
    (wheel,) = wheels.glob("kmp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kmp/__init__.py" in names and "kmp_cli/__init__.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)

    env = tmp_path / "env"
    # No pip of its own (ensurepip is the slow part of a venv): the project's
    # pip installs into it (`pip --python`).
    run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    # The project's own environment already has TensorFlow and Keras: the
    # fresh one sees them (as an existing project's environment would).
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    pathlib.Path(site.stdout.strip(), "deps.pth").write_text(
        sysconfig.get_path("purelib") + "\n"
    )
    pip = (sys.executable, "-m", "pip", "--python", python)
    run(*pip, "install", "-q", "--no-deps", "--no-index", wheel)
    run(*pip, "check")  # its declared dependencies are met

    version = run(env / "bin" / "kmp", "--version")
    assert version.stdout.strip() == f"kmp {kmp.__version__}"
    used = run(
        python,
        "-c",
        "import kmp, kmp_cli, sys; print(kmp.__file__); "
        "sys.exit(kmp_cli.main(['policies']))",
        cwd=tmp_path,  # not the checkout, whose kmp/ would shadow the install
    )
    assert used.stdout.startswith(site.stdout.strip())
    assert "'auto' on this machine:" in used.stdout
