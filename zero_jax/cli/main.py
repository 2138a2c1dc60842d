"""`zero-jax SUBCOMMAND [args]`: the scripts in scripts/ under one command.

    zero-jax train --devices 8 --steps 100      # = python scripts/train.py --devices 8 --steps 100
    zero-jax train --help

Each subcommand runs its script as `python scripts/<script>.py` would (as
`__main__`, with scripts/ first on sys.path), so the scripts stay the one
place their flags are defined and keep working on their own. They live in
the source tree beside the package, not in it: an editable install
(`pip install -e .`, what `make` does) finds them; any other install has no
scripts/ to run, and says so.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parent.parent.parent / "scripts"
# subcommand -> script in scripts/
COMMANDS = {"train": "train.py", "plan": "plan.py", "memory": "memory_report.py",
            "export": "export.py", "launch": "launch.py", "bench": "bench.py"}


def summary(script: Path) -> str:
    """The first line of a script's docstring, read without running it."""
    try:
        doc = ast.get_docstring(ast.parse(script.read_text()))
    except (OSError, SyntaxError):
        doc = None
    return doc.strip().splitlines()[0] if doc else f"({script.name} is missing)"


def usage(scripts_dir: Path = SCRIPTS_DIR) -> str:
    rows = [f"  {name:<8}{summary(scripts_dir / script)}" for name, script in COMMANDS.items()]
    return "\n".join(["usage: zero-jax SUBCOMMAND [args ...]", "",
                      "subcommands (zero-jax SUBCOMMAND --help: its flags):", *rows])


def missing(name: str, script: Path) -> str:
    if not script.parent.is_dir():
        return (f"error: zero-jax {name} runs {script.parent.name}/{script.name} from the source "
                f"tree, and there is no {script.parent} beside this installed package; install "
                "from a clone with `pip install -e .` (or `make`), or run the script from a clone")
    return f"error: zero-jax {name}: {script} is not in this checkout"


def run_script(script: Path, argv: list[str]) -> int:
    """Run `script` as `python script argv...` would, in this process; its exit status."""
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))  # the scripts import their neighbours (timing, procmem)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # the scripts end with sys.exit(main())
        if isinstance(e.code, str):  # sys.exit("message"): Python would print it
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


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
    script = SCRIPTS_DIR / COMMANDS[name]
    if not script.is_file():
        print(missing(name, script), file=sys.stderr)
        return 2
    return run_script(script, rest)


if __name__ == "__main__":
    sys.exit(main())
