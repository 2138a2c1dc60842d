"""The library stays walkable: short files, short functions (STYLE.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("zero_jax", "models")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60  # decorators and docstring included
# Values that travel together are one record (STYLE.md: one frozen options
# record, not 12 positional values through three calls).
MAX_PARAMETERS = 8  # self and cls not counted; *args, **kwargs and a record count one each


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


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    """The parameters a caller can pass: every positional and keyword-only
    one, and *args and **kwargs one each; a method's self or cls not."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    count = len(positional) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (bool(positional) and positional[0].arg in ("self", "cls"))


def many_parameters(path: Path, limit: int = MAX_PARAMETERS) -> list[str]:
    """`path:line name count` of every function, method or lambda taking more than `limit`."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    functions = sorted((node for node in ast.walk(ast.parse(path.read_text()))
                        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))),
                       key=lambda node: (node.lineno, node.col_offset))
    return [f"{where}:{node.lineno} {getattr(node, 'name', '<lambda>')} {n}"
            for node in functions if (n := parameter_count(node)) > limit]


def test_no_function_of_the_library_takes_more_than_8_parameters():
    library = sorted((ROOT / "zero_jax").rglob("*.py"))
    assert [f for p in library for f in many_parameters(p)] == []


def test_the_parameter_count_counts_what_a_caller_passes(tmp_path):
    """The check itself: self not counted; keyword-only, *args and **kwargs
    counted once each; nested functions and lambdas seen."""
    source = tmp_path / "m.py"
    source.write_text(
        "class A:\n"
        "    def method(self, a, b, c, d, e, f, g, h): pass\n"  # 8 besides self
        "    @classmethod\n"
        "    def make(cls, a, b, c, d, e, f, g, h, i): pass\n"  # 9 besides cls
        "def f(a, b, /, c, *args, d, e=1, **kwargs):\n"  # 2 + 1 + 1 + 2 + 1 = 7
        "    def inner(a, b, c, d, e, f, g, h, i): pass\n"
        "    return lambda a, b, c, d, e, f, g, h, i, j: a\n"
        "def g(a, *, options): pass\n")  # a record counts as one
    assert many_parameters(source) == ["m.py:4 make 9", "m.py:6 inner 9", "m.py:7 <lambda> 10"]
    counts = {n.name: parameter_count(n) for n in ast.walk(ast.parse(source.read_text()))
              if isinstance(n, ast.FunctionDef)}
    assert counts == {"method": 8, "make": 9, "f": 7, "inner": 9, "g": 2}
    assert many_parameters(source, limit=6) == [
        "m.py:2 method 8", "m.py:4 make 9", "m.py:5 f 7", "m.py:6 inner 9", "m.py:7 <lambda> 10"]


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
