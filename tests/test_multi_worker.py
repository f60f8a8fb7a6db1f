"""MultiWorkerMirroredStrategy with two worker processes on 127.0.0.1.

The example starts both workers itself (bounded by a timeout, killed on
failure); this test checks what they report.
"""

import json
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def loopback_available() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_two_workers_agree_and_skip_the_poisoned_step_together():
    if not loopback_available():
        pytest.skip("this machine cannot open loopback ports")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multi_worker.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [r["worker"] for r in reports] == [0, 1]
    first, second = reports
    # The NaN sits in worker 1's half of batch 1: both workers skip it.
    assert first["applied"] == second["applied"] == [True, False, True, True]
    assert first["skipped_steps_total"] == second["skipped_steps_total"] == 1
    assert first["loss_scale"] == second["loss_scale"] == 32.0
    assert first["weights"] == second["weights"]
    assert all(abs(v) < 10 for w in first["weights"] for v in w)  # finite, sane
