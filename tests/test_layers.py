"""kmp's layering (declared in pyproject.toml) is checked by import-linter,
and an import that runs upward breaks it."""

import pathlib
import shutil
import subprocess
import sys

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


def test_an_upward_import_breaks_the_layers(tmp_path):
    _copy_of_kmp(tmp_path)
    kinds = tmp_path / "kmp" / "precision" / "kinds.py"
    kinds.write_text(kinds.read_text() + "\nfrom kmp.diagnostics import report\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "kmp.precision is not allowed to import kmp.diagnostics" in result.stdout
    assert "kmp.precision.kinds -> kmp.diagnostics.report" in result.stdout


def test_the_precision_core_importing_tensorflow_breaks_the_contract(tmp_path):
    _copy_of_kmp(tmp_path)
    rules = tmp_path / "kmp" / "precision" / "rules.py"
    rules.write_text(rules.read_text() + "\nimport tensorflow\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "kmp.precision is not allowed to import tensorflow" in result.stdout
