"""The suite's own machinery: the tests of one `xdist_group` run on one
worker, as `make test` runs them (the references they share are computed
once per worker)."""

import re
import subprocess
import sys


def test_the_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n"
        "@pytest.mark.xdist_group('shared')\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_grouped(i): pass\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_free(i): pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", "test_grouped.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    workers = re.findall(r"\[(gw\d)\] .*PASSED .*test_grouped\[", result.stdout)
    assert len(workers) == 4, result.stdout[-2000:]
    assert len(set(workers)) == 1, result.stdout[-2000:]
