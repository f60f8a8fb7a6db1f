"""kmp installs into an existing environment as the README says: a wheel
built from the checkout, installed with pip into a fresh virtual
environment whose dependencies (TensorFlow, Keras, NumPy) are already
there, then imported and run from there, not from the checkout. And into
one that has Keras and JAX but no TensorFlow, where it trains on JAX."""

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from packaging.requirements import Requirement

import kmp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, fails=False, **kwargs):
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **kwargs,
    )
    assert (result.returncode != 0) == fails, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """kmp's wheel, built from a copy of the sources, so that no build/ left
    in the checkout (whose build/lib may hold deleted modules) goes in."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    skip = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*cache")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*skip))
    wheels = tmp_path / "wheels"
    # setuptools comes with the test extra, so the build needs no network.
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "-q", "-w", wheels, source)  # fmt: skip
    (built,) = wheels.glob("kmp-*.whl")
    return built


@pytest.mark.slow
@pytest.mark.xdist_group("install")
def test_kmp_installs_into_a_fresh_virtual_environment(tmp_path, wheel):
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


def _installed_with_dependencies(names: list[str]) -> set[str]:
    """The distributions `names` need, themselves included: their
    requirements, without extras, as this environment has them."""
    found: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found.add(key)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _link_distributions(names: set[str], site: pathlib.Path) -> None:
    """Links each distribution's top-level files and its metadata from this
    environment into `site`: an environment with those alone."""
    for name in names:
        dist = importlib.metadata.distribution(name)
        tops = {pathlib.PurePath(f).parts[0] for f in dist.files or []}
        for top in tops:
            if top.startswith("..") or top == "__pycache__":
                continue
            target = pathlib.Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)


@pytest.mark.slow
@pytest.mark.xdist_group("install")
def test_kmp_installs_and_trains_on_jax_without_tensorflow(tmp_path, wheel):
    env = tmp_path / "env"
    run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    site = pathlib.Path(
        run(
            python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"
        ).stdout.strip()
    )
    needed = _installed_with_dependencies(["keras", "jax"])
    assert "tensorflow" not in needed, "precondition: Keras and JAX need no TF"
    _link_distributions(needed, site)
    pip = (sys.executable, "-m", "pip", "--python", python)
    run(*pip, "install", "-q", "--no-deps", "--no-index", wheel)
    run(*pip, "check")  # kmp's own requirements hold without TensorFlow
    no_tensorflow = run(python, "-c", "import tensorflow", fails=True)
    assert "No module named 'tensorflow'" in no_tensorflow.stderr

    trained = run(
        python,
        "-c",
        "import sys, keras, numpy as np, kmp; "
        "kmp.set_policy('mixed_float16'); "
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]); "
        "kmp.compile(model, 'sgd', 'mse'); "
        "h = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0); "
        "print(sorted(h.history), kmp.__file__)",
        cwd=tmp_path,  # not the checkout, whose kmp/ would shadow the install
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )
    assert "'loss_scale', 'skipped_steps', 'skipped_steps_total'" in trained.stdout
    assert str(site) in trained.stdout
    doctor = run(
        env / "bin" / "kmp", "doctor", env={**os.environ, "KERAS_BACKEND": "jax"}
    )
    assert "tensorflow not installed" in doctor.stdout
