"""Every code block in the README and the guides in docs/ runs, every
link between them resolves, the documentation site builds, and every
example script runs."""

import contextlib
import importlib.util
import io
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The README, then each guide: name (relative to the root) -> text.
PAGES = {
    "README.md": README,
    **{
        f"docs/{path.name}": path.read_text()
        for path in sorted((ROOT / "docs").glob("*.md"))
    },
}
# (page, index) -> the code of one ```python block, in page order.
BLOCKS = {
    (name, index): block
    for name, text in PAGES.items()
    for index, block in enumerate(
        re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    )
}
SHELL_BLOCKS = [
    block
    for text in PAGES.values()
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)
]


def example_output(name: str, *args: str) -> str:
    """Runs examples/<name> as `python examples/<name> ARGS` would (as
    `__main__`, in a namespace of its own, with its own `sys.argv`), in this
    process: one TensorFlow start-up less per example. Returns what it
    printed; fails the test if it raises."""
    path = str(ROOT / "examples" / name)
    argv = sys.argv
    sys.argv = [path, *args]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    """Runs examples/<name> in a process of its own, as a user would (for an
    example that sets up devices of its own); fails the test if it fails."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


def test_shell_commands_exist():
    """Each command in the shell blocks of the README and the guides is a
    real one: `make` targets are in the Makefile, `kmp ...` lines parse with
    the CLI, `pip install` lines name extras the package has, and the
    examples run under JAX exist."""
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
        elif words[:2] == ["KERAS_BACKEND=jax", "python"]:
            assert (ROOT / words[2]).is_file(), command  # an example
        elif words[0] == "pip":
            assert words[1] in ("install", "wheel"), command
            for named in re.findall(r"\[([\w,]+)\]", command):
                assert set(named.split(",")) <= set(extras), command
        else:
            assert words[0] == "kmp", command
            if words[1:] != ["--version"]:
                kmp_cli.build_parser().parse_args(words[1:])


@pytest.mark.parametrize(
    "page, index", list(BLOCKS), ids=[f"{name}[{i}]" for name, i in BLOCKS]
)
def test_python_block_runs(page, index):
    """Each block runs on its own, in a fresh namespace (kmp's state is reset
    between tests): no block relies on one before it."""
    code = BLOCKS[page, index]
    exec(compile(code, f"{page}[block {index}]", "exec"), {})


def _expand_snippets(text: str) -> str:
    """A page as MkDocs renders it: `--8<-- "FILE:SECTION"` lines
    (pymdownx.snippets) replaced with that section of FILE."""

    def section(match: re.Match) -> str:
        path, _, name = match[1].partition(":")
        source = (ROOT / path).read_text()
        if not name:
            return source
        found = re.search(
            rf"--8<-- \[start:{name}\].*?\n(.*?)^[^\n]*--8<-- \[end:{name}\]",
            source,
            flags=re.DOTALL | re.M,
        )
        assert found, f"no section {name!r} in {path}"
        return found[1]

    return re.sub(r'^--8<-- "([^"]+)"$', section, text, flags=re.M)


def _anchors(text: str) -> set[str]:
    """The ids of a page's headings, as GitHub and MkDocs's toc make them."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)
    }


def _links(text: str) -> list[str]:
    """The targets of a page's Markdown links, outside code."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _headings(path: pathlib.Path) -> set[str]:
    return _anchors(_expand_snippets(path.read_text()))


def test_every_relative_link_resolves():
    """Each relative link in the README and the guides (the guides as the
    site renders them, with the README's sections they include) names a
    file that exists, and an anchor that is one of its headings."""
    broken = []
    for name, text in PAGES.items():
        rendered = _expand_snippets(text)
        for link in _links(rendered):
            if re.match(r"[a-z]+:", link):
                continue  # https:, mailto:
            path, _, anchor = link.partition("#")
            target = (ROOT / name).parent / path if path else ROOT / name
            if not target.is_file():
                broken.append(f"{name}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in _headings(target):
                broken.append(f"{name}: {link} (no such heading)")
    assert not broken


def test_every_guide_is_linked_from_the_readme_and_in_the_site_nav():
    """A guide in docs/ that the README does not link, or that mkdocs.yml's
    nav leaves out, is one nobody finds. (docs/index.md is the site's home,
    which shows the README's own sections.)"""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.search(r"^nav:\n((?:[ \t]+.*\n)+)", config, flags=re.M)
    assert nav, "mkdocs.yml has no nav"
    in_nav = set(re.findall(r"([\w/-]+\.md)\s*$", nav[1], flags=re.M))
    guides = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert guides == in_nav
    linked = {
        link.partition("#")[0].removeprefix("docs/")
        for link in _links(README)
        if link.startswith("docs/")
    }
    assert guides - {"index.md"} <= linked


@pytest.mark.slow
def test_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (as `make lint` runs it): every page, link
    and API-reference entry resolves, with no warning from the docstrings."""
    for module, package in (
        ("mkdocs", "mkdocs"),
        ("mkdocstrings_handlers.python", "mkdocstrings-python"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            pytest.skip(f"{package} is not installed (it is in the test extra)")
    site = str(tmp_path / "site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="kmp.set_policy"' in api and 'id="kmp.LossScaleOptimizer"' in api


@pytest.mark.slow
def test_quickstart_example_trains_and_reports():
    out = example_output("quickstart.py")
    # Keras numbers a model's default name by the models made before it in
    # the process ('sequential_2', ...).
    assert re.search(r"Precision of 'sequential(_\d+)?'", out)
    accuracy = float(re.search(r"final accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.5  # 10 classes: chance is 0.1


@pytest.mark.slow
def test_custom_loop_example_trains_without_skips():
    out = example_output("custom_loop.py")
    assert "loss scale" in out
    accuracy = float(re.search(r"train accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.8  # 4 classes: chance is 0.25


@pytest.mark.slow
def test_debug_nan_example_finds_the_layer():
    out = example_output("debug_nan.py")
    assert "Training collapsed" in out
    assert "weights all finite: True" in out
    assert "found layer: amplifier" in out
    scale = float(re.search(r"loss scale back up to ([0-9.e+]+)", out)[1])
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
    out = example_output("transformer.py")
    assert "block1_attention/query" in out and "attention scores in float32" in out
    assert "output dtype: <dtype: 'float32'>" in out
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.6  # 4 classes: chance is 0.25


@pytest.mark.slow
def test_tf_keras_guide_style_code_trains_on_kmp():
    out = example_output("migrate_from_tf_keras.py")
    assert "loss scale" in out
    accuracy = float(re.search(r"train accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.9  # 10 classes: chance is 0.1


@pytest.mark.slow
def test_qlora_example_fine_tunes_a_quantized_lora_llama_above_chance():
    # The loss-scaled run at half the default steps; int8 and 'auto'
    # (bfloat16 here) are tested in tests/test_quantization.py.
    out = example_output(
        "qlora.py", "--steps", "60", "--modes", "int4", "--policies", "mixed_float16"
    )
    runs = re.findall(
        r"\n(\S+) \((\S+)\), (int\d) base.*?loss scale: (\S+);.*?"
        r"accuracy: ([0-9.]+) before, ([0-9.]+) after \(chance ([0-9.]+)\)",
        out,
        flags=re.DOTALL,
    )
    assert {(policy, mode) for policy, _, mode, *_ in runs} == {
        ("mixed_float16", "int4")
    }
    for policy, resolved, mode, scale, before, after, chance in runs:
        assert float(after) > max(3 * float(chance), float(before)), (policy, mode)
        assert (scale != "none") == (resolved == "mixed_float16"), (policy, scale)
    assert "trainable of" in out and "bytes" in out


def test_user_facing_text_has_no_internal_references():
    """The README, the guides and kmp's own text (docstrings, messages,
    doctor's warnings, which travel with the installed package) speak of
    behaviour: no issue numbers, no benchmarks/RESULTS.md (not installed),
    no "this project's" machine."""
    texts = dict(PAGES)
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
