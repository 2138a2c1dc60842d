"""The library stays walkable: short files, short functions (STYLE.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("zero_jax", "models")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60  # decorators and docstring included


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (n lines)` of every function or method longer than `limit`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = node.end_lineno - start + 1
            if lines > limit:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_is_over_60_lines():
    assert [f for p in sources() for f in long_functions(p)] == []


def test_the_walk_sees_every_function(tmp_path):
    """The check itself: a method inside a class, counted from its decorator."""
    body = "\n".join(f"        x = {i}" for i in range(MAX_FUNCTION_LINES - 2))
    source = tmp_path / "m.py"
    source.write_text(f"class A:\n    @staticmethod\n    def f():\n{body}\n")
    assert long_functions(source) == []  # exactly the limit
    assert long_functions(source, MAX_FUNCTION_LINES - 1) == ["m.py:3 f (60 lines)"]


def test_every_subpackage_is_installed():
    """A package pyproject.toml does not list is missing from a wheel (an
    editable install and the source tree still find it, so nothing else fails)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for package in PACKAGES
             for p in (ROOT / package).rglob("__init__.py")}
    assert found - listed == set()
