"""`zero-jax SUBCOMMAND [args]`: the library's commands under one name.

    zero-jax train --devices 8 --steps 100
    zero-jax train --help
    python -m zero_jax train --devices 8     # the same, by module

Each subcommand is a module of zero_jax/cli/ with a `main(argv) -> int`
(in a source tree each also has a two-line shim in the scripts folder).
`--help` lists the subcommands with the first line of each module's
docstring, read from its file without importing it (the modules import JAX,
which takes seconds to start).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys

PACKAGE = "zero_jax.cli"
# subcommand -> its module in zero_jax/cli/ (and the source tree's shim of the same stem)
COMMANDS: dict[str, str] = {"train": "train", "plan": "plan", "memory": "memory_report",
                            "export": "export", "launch": "launch", "bench": "bench",
                            "prepare-data": "prepare_data"}


def summary(stem: str) -> str:
    """The first line of a subcommand module's docstring, read without running it."""
    spec = importlib.util.find_spec(f"{PACKAGE}.{stem}")
    try:
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
    except (AttributeError, TypeError, OSError, SyntaxError):  # no module, or no source file
        doc = None
    return doc.strip().splitlines()[0] if doc else f"({stem}.py has no docstring)"


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    rows = [f"  {name:<{width}}{summary(stem)}" for name, stem in COMMANDS.items()]
    return "\n".join(["usage: zero-jax SUBCOMMAND [args ...]", "",
                      "subcommands (zero-jax SUBCOMMAND --help: its flags):", *rows])


def run(name: str, argv: list[str]) -> int:
    """Subcommand `name`'s main(argv), its usage lines naming it `zero-jax NAME`."""
    module = importlib.import_module(f"{PACKAGE}.{COMMANDS[name]}")
    saved = sys.argv[:1]
    # argparse names the program in usage lines after sys.argv[0].
    sys.argv[:1] = [f"zero-jax {name}"]
    try:
        return module.main(argv)
    finally:
        sys.argv[:1] = saved


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: zero-jax {name}: no such subcommand; choose from {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
