"""kmp's layering (declared in pyproject.toml) is checked by import-linter,
and an import that runs upward breaks it."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"


def _lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
    )


def _copy_of_kmp(tmp_path: pathlib.Path) -> None:
    for part in ("kmp", "kmp_cli", "pyproject.toml"):
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(
                source, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(source, tmp_path / part)


def test_the_layers_hold():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "module, added, said",
    [
        # An upward import: the precision core reaching into diagnostics.
        (
            "kinds.py",
            "from kmp.diagnostics import report",
            [
                "kmp.precision is not allowed to import kmp.diagnostics",
                "kmp.precision.kinds -> kmp.diagnostics.report",
            ],
        ),
        # The precision core importing TensorFlow.
        (
            "rules.py",
            "import tensorflow",
            ["kmp.precision is not allowed to import tensorflow"],
        ),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, added, said):
    _copy_of_kmp(tmp_path)
    path = tmp_path / "kmp" / "precision" / module
    path.write_text(path.read_text() + f"\n{added}\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    for line in said:
        assert line in result.stdout
