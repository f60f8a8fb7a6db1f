"""The public API is a checked-in list, so that changes show up in review.

`tests/api.txt` lists every public name, under `#` headings; docs/api.md is
generated from it: `python tests/test_api.py` writes it again.
"""

import ast
import pathlib
import re
import types

import kmp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _public_names() -> list[str]:
    """Every public name: those of `kmp.__all__`, and those of the
    `__all__` of each public module among them, as `kmp.module.name`."""
    names = []
    for name in kmp.__all__:
        names.append(f"kmp.{name}")
        obj = getattr(kmp, name)
        if isinstance(obj, types.ModuleType):
            names += [f"kmp.{name}.{sub}" for sub in obj.__all__]
            for sub in obj.__all__:
                assert hasattr(obj, sub), f"kmp.{name}.{sub}"
    return names


API_LIST = ROOT / "tests" / "api.txt"
API_PAGE = ROOT / "docs" / "api.md"


def _listed() -> list[str]:
    """The names in tests/api.txt, in its order."""
    lines = API_LIST.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def api_page() -> str:
    """docs/api.md, as generated from tests/api.txt."""
    out = [
        "# API reference",
        "",
        "Every public name of kmp, from its docstring. Each is reached as an",
        "attribute of `kmp` (`kmp.set_policy`, `kmp.debug.find_nonfinite`).",
        "This page is generated from `tests/api.txt`.",
    ]
    for line in API_LIST.read_text().splitlines():
        if line.startswith("# "):
            out += ["", f"## {line[2:]}"]
        elif line:
            out += ["", f"::: {line}"]
            if isinstance(eval(line, {"kmp": kmp}), types.ModuleType):
                out += ["    options:", "      members: false"]
    return "\n".join(out) + "\n"


def test_the_api_page_is_generated_from_the_list():
    assert API_PAGE.read_text() == api_page(), "run: python tests/test_api.py"


def test_public_names_of_every_public_module_match_the_checked_in_list():
    expected = _listed()
    assert sorted(_public_names()) == sorted(expected)
    for name in kmp.__all__:
        assert hasattr(kmp, name), name


def test_init_only_re_exports():
    tree = ast.parse((ROOT / "kmp" / "__init__.py").read_text())
    for node in tree.body:
        assert isinstance(node, (ast.ImportFrom, ast.Import, ast.Assign, ast.Expr)), (
            f"kmp/__init__.py line {node.lineno} does more than re-export"
        )


def test_every_public_function_has_a_docstring_with_an_example():
    for name in kmp.__all__:
        obj = getattr(kmp, name)
        if callable(obj) and name[0].islower():
            doc = obj.__doc__ or ""
            assert ">>>" in doc, f"kmp.{name} has no runnable example"


def test_every_kmp_warning_is_issued_at_the_users_line():
    # kmp._warn.warn finds the first caller outside kmp; a plain
    # warnings.warn with a fixed stacklevel points into kmp when the call
    # comes through another kmp function.
    package = pathlib.Path(kmp.__file__).parent
    direct = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package).as_posix() != "_base/warn.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "warnings.warn(" in line
    ]
    assert direct == []


def _kmp_imports() -> dict[str, set[str]]:
    """Each kmp module -> the kmp modules it imports anywhere: at the top,
    inside functions, and under `typing.TYPE_CHECKING`."""
    package = ROOT / "kmp"
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "kmp"
            ):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    found.add(name if name in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("kmp"))
        graph[module] = {m for m in found if m in modules and m != module}
    return graph


def test_no_kmp_module_imports_one_that_imports_it_back():
    # Stricter than a circle at run time: imports inside functions and
    # under TYPE_CHECKING count too.
    graph = _kmp_imports()
    assert "kmp.precision.names" in graph["kmp.precision.rules"]  # precondition
    circles = []
    for start in sorted(graph):
        # Depth-first from `start`: a path back to it is a circle.
        stack = [(start, (start,))]
        seen = set()
        while stack:
            module, path = stack.pop()
            for imported in sorted(graph[module]):
                if imported == start:
                    circles.append(" -> ".join((*path, start)))
                elif imported not in seen:
                    seen.add(imported)
                    stack.append((imported, (*path, imported)))
    assert circles == []


def _public_docstrings():
    """(name, docstring) of every public name, and of the public members of
    the public classes."""
    for name in _listed():
        obj = eval(name, {"kmp": kmp})
        yield name, obj.__doc__ or ""
        if isinstance(obj, type):
            for member, value in vars(obj).items():
                if not member.startswith("_"):
                    value = getattr(value, "fget", value)
                    yield f"{name}.{member}", getattr(value, "__doc__", "") or ""


def test_public_docstring_examples_use_only_public_names():
    public = set(_listed())
    modules = {n for n in public if isinstance(eval(n, {"kmp": kmp}), types.ModuleType)}
    found = []
    for owner, doc in _public_docstrings():
        for line in doc.splitlines():
            if not line.lstrip().startswith((">>>", "...")):
                continue
            for match in re.finditer(r"(?<![\w.])kmp\.\w+(?:\.\w+)?", line):
                name = match.group()
                head = ".".join(name.split(".")[:2])
                if head not in public or (head in modules and name not in public):
                    found.append(f"{owner}: {name}")
    assert found == []


def test_public_docstrings_name_no_internal_module():
    internal = r"kmp\.(backend|diagnostics|internals|planning|precision|scaling|"
    internal += r"tools|training|_base)\.\w+"
    found = [
        f"{owner}: {match.group()}"
        for owner, doc in _public_docstrings()
        for match in re.finditer(internal, doc)
    ]
    assert found == []


if __name__ == "__main__":
    API_PAGE.write_text(api_page())
