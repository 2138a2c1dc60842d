"""The house's floor plan: every import of `zero_jax/` and `models/` goes to
its own layer or one below, and no files import each other in a circle.

The layers, bottom to top, are written once here (and drawn in
docs/architecture.md). A module's layer is its subpackage (`zero_jax.train.step`
-> train) or, at the top, its own name (`zero_jax.job` -> job). Imports are
read from the source, those inside functions too: a deferred import is still
a dependency, only a later one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("zero_jax", "models")

# Bottom to top. A layer may import itself and any layer before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),  # the run config: data, loading, flags, paths; nothing of JAX
    ("runtime",),  # the process: devices, distributed start-up, metrics, tracing, device kinds
    ("sharding",),  # meshes, rules, ZeRO layouts, host offload, overlap options
    ("data", "context"),  # batches; attention across a context axis
    ("model",),  # the contract a model implements, the hooks it calls, remat, loss
    ("precision",),  # dtype policies, master weights, loss scaling
    ("pipeline",),  # schedules and the pipelined loss and gradients
    ("train",),  # the state, the step, accumulation, the optimizer
    ("checkpoint",),  # saves, restores, exports
    ("analysis",),  # bytes, traffic, collectives, FLOPs of a compiled step
    ("job",),  # a config and a model -> everything a run needs
    ("models",),  # the reference models (a package beside zero_jax)
    ("planner", "report", "bench"),  # what reads a Job: layouts searched, the plan printed, benchmarks
    ("loop",),  # the host loop
    ("run",),  # a run end to end
    ("cli",),  # the command line
    ("__main__",),
)
RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in layer}


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the packages that `path` imports, anywhere in it;
    `from package import name` counts as the module `package.name` where
    that is one, else as the package."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in PACKAGES:
            for a in node.names:
                name = f"{node.module}.{a.name}"
                out.add(name if name in known else node.module)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def layer(module: str) -> str | None:
    """A module's layer name; None for a package's own top (`zero_jax`)."""
    parts = module.split(".")
    if parts[0] == "models":
        return "models"
    return parts[1] if len(parts) > 1 else None


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one, and every module in
    no layer."""
    problems = []
    for module, targets in sorted(edges.items()):
        own = layer(module)
        if own is not None and own not in RANK:
            problems.append(f"{module}: in no layer (add {own!r} to LAYERS, or move it)")
            continue
        for target in sorted(targets):
            theirs = layer(target)
            if own is None or theirs is None or theirs not in RANK:
                continue
            if RANK[theirs] > RANK[own]:
                problems.append(f"{module} ({own}) imports {target} ({theirs}), a higher layer")
    return problems


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import each other, directly or round a loop
    (Tarjan's strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_runs_up_the_house():
    assert upward(graph()) == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_the_top_holds_only_what_a_reader_follows():
    top = sorted(p.stem for p in (ROOT / "zero_jax").glob("*.py"))
    assert top == ["__init__", "__main__", "job", "loop", "run"]


@pytest.mark.parametrize("edges, expected", [
    ({"zero_jax.config.load": {"zero_jax.train.step"}, "zero_jax.train.step": set()},
     ["zero_jax.config.load (config) imports zero_jax.train.step (train), a higher layer"]),
    ({"zero_jax.stray": set()}, ["zero_jax.stray: in no layer (add 'stray' to LAYERS, or move it)"]),
])
def test_the_check_names_what_runs_up(edges, expected):
    assert upward(edges) == expected


def test_the_check_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]


def test_the_architecture_page_draws_these_layers():
    """docs/architecture.md draws the layers top down, one line each: the
    same order as LAYERS (a top-level module drawn as job.py, a package as
    train/)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawing = text.split("## The layers", 1)[1].split("```")[1]
    drawn = [tuple(_leading_names(line)) for line in drawing.strip("\n").splitlines()]
    assert drawn == [layer for layer in reversed(LAYERS) if layer != ("__main__",)]


def _leading_names(line: str):
    """The packages and modules a drawn line starts with, before its words."""
    for word in line.split():
        if not word.endswith(("/", ".py")):
            return
        yield word.removesuffix("/").removesuffix(".py")
