"""A test's script run in a Python process of its own, for what must not
share the test process (a fresh TensorFlow, a cluster it connects to)."""


def in_fresh_process(script: str, *args: str) -> dict:
    """Runs `script` in a Python process of its own with `args` and returns
    the JSON object its last line prints (fails the test if it fails)."""
    import json
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
