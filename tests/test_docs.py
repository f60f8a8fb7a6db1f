"""Every Python code block in the README runs, and every example script runs."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    """Runs examples/<name> as a user would; fails the test if it fails."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


SHELL_BLOCKS = re.findall(r"```sh\n(.*?)```", README, flags=re.DOTALL)


def test_readme_shell_commands_exist():
    """Each command in the README's shell blocks is a real one: `make`
    targets are in the Makefile, `kmp ...` lines parse with the CLI, and
    `pip install` lines name extras the package has."""
    import tomllib

    import kmp_cli

    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    commands = [
        line.split("#")[0].strip()
        for block in SHELL_BLOCKS
        for line in block.splitlines()
        if line.split("#")[0].strip()
    ]
    assert commands
    for command in commands:
        words = command.split()
        if words[0] == "make":
            assert re.search(rf"^{words[1]}:", makefile, re.M), command
        elif words[:3] == ["python", "-m", "kmp"]:
            continue  # the same entry point as `kmp`
        elif words[0] == "pip":
            assert words[1] in ("install", "wheel"), command
            for named in re.findall(r"\[([\w,]+)\]", command):
                assert set(named.split(",")) <= set(extras), command
        else:
            assert words[0] == "kmp", command
            if words[1:] != ["--version"]:
                kmp_cli.build_parser().parse_args(words[1:])


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md[block {index}]", "exec"), {})


@pytest.mark.slow
def test_quickstart_example_trains_and_reports():
    result = run_example("quickstart.py")
    assert "Precision of 'sequential'" in result.stdout
    accuracy = float(re.search(r"final accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.5  # 10 classes: chance is 0.1


@pytest.mark.slow
def test_custom_loop_example_trains_without_skips():
    result = run_example("custom_loop.py")
    assert "loss scale" in result.stdout
    accuracy = float(re.search(r"train accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.8  # 4 classes: chance is 0.25


@pytest.mark.slow
def test_debug_nan_example_finds_the_layer():
    result = run_example("debug_nan.py")
    assert "Training collapsed" in result.stdout
    assert "weights all finite: True" in result.stdout
    assert "found layer: amplifier" in result.stdout
    scale = float(re.search(r"loss scale back up to ([0-9.e+]+)", result.stdout)[1])
    assert scale > 1.0  # the scale recovered once the bug was fixed


@pytest.mark.slow
def test_distributed_example_trains_on_two_replicas_and_skips_the_nan():
    result = run_example("distributed.py")
    assert "replicas: 2" in result.stdout
    for line in ("fit:", "loop:"):
        row = next(r for r in result.stdout.splitlines() if r.startswith(line))
        assert float(re.search(r"accuracy ([0-9.]+)", row).group(1)) > 0.85
        assert "skipped steps 3" in row  # the NaN batch, once per epoch
        assert "replicas checked: 2" in row


@pytest.mark.slow
def test_transformer_example_applies_the_rules_and_learns():
    out = run_example("transformer.py").stdout
    assert "block1_attention/query" in out and "attention scores in float32" in out
    assert "output dtype: <dtype: 'float32'>" in out
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.6  # 4 classes: chance is 0.25


@pytest.mark.slow
def test_tf_keras_guide_style_code_trains_on_kmp():
    out = run_example("migrate_from_tf_keras.py").stdout
    assert "loss scale" in out
    accuracy = float(re.search(r"train accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.9  # 10 classes: chance is 0.1


@pytest.mark.slow
def test_qlora_example_fine_tunes_a_quantized_lora_llama_above_chance():
    # The loss-scaled run at half the default steps; int8 and 'auto'
    # (bfloat16 here) are tested in tests/test_quantization.py.
    result = run_example(
        "qlora.py", "--steps", "60", "--modes", "int4", "--policies", "mixed_float16"
    )
    runs = re.findall(
        r"\n(\S+) \((\S+)\), (int\d) base.*?loss scale: (\S+);.*?"
        r"accuracy: ([0-9.]+) before, ([0-9.]+) after \(chance ([0-9.]+)\)",
        result.stdout,
        flags=re.DOTALL,
    )
    assert {(policy, mode) for policy, _, mode, *_ in runs} == {
        ("mixed_float16", "int4")
    }
    for policy, resolved, mode, scale, before, after, chance in runs:
        assert float(after) > max(3 * float(chance), float(before)), (policy, mode)
        assert (scale != "none") == (resolved == "mixed_float16"), (policy, scale)
    assert "trainable of" in result.stdout and "bytes" in result.stdout


def test_user_facing_text_has_no_internal_references():
    """The README and kmp's own text (docstrings, messages, doctor's
    warnings) travel with the installed package: no issue numbers, no
    benchmarks/RESULTS.md (not installed), no "this project's" machine."""
    texts = {"README.md": README}
    for package in ("kmp", "kmp_cli"):
        for path in (ROOT / package).rglob("*.py"):
            texts[str(path.relative_to(ROOT))] = path.read_text()
    internal = re.compile(
        r"RESULTS\.md|\bissue #?\d+|(?<![\w/-])#\d{1,3}\b|this project's"
    )
    found = {
        name: internal.findall(text)
        for name, text in texts.items()
        if internal.search(text)
    }
    assert not found
