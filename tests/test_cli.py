import subprocess
import sys

import pytest

import kmp
from kmp import cli


def test_policies_command_prints_the_table_and_the_auto_choice(capsys):
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "mixed_float16   float16   float32    yes" in out
    assert "mixed_bfloat16  bfloat16  float32    no" in out
    assert "'auto' on this machine:" in out


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: kmp" in capsys.readouterr().err


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as info:
        cli.main(["fly"])
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
