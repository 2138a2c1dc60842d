"""Every flag of every script says what it does in --help.

The scripts' --help texts are gathered in one process (each script run as
`python scripts/X.py --help` would run it, by runpy): most of them import
JAX, and one interpreter start for all of them keeps the test fast.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The entry points: scripts/*.py that run as programs (not the modules they share).
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "scripts").glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())

# Runs each script's --help as `python SCRIPT --help` does (the script's own
# folder first on sys.path) and prints, as its last line,
# {script: [exit status, stdout, stderr]}.
GATHER = r"""
import contextlib, io, json, runpy, sys, traceback
out = {}
for path in sys.argv[1:]:
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    sys.argv, sys.path[0] = [path, "--help"], path.rsplit("/", 1)[0]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    out[path] = [code, stdout.getvalue(), stderr.getvalue()]
sys.stdout.write("\n" + json.dumps(out) + "\n")
"""

# A section heading ("options:", "[train]:") and a line naming an argument:
# two spaces, then the flags or the positional's name, then two or more spaces
# and its help, if the help fits on the same line.
HEADING = re.compile(r"^\S.*:$")
ARGUMENT = re.compile(r"^  (?P<invocation>\S.*?)(?: {2,}(?P<help>\S.*))?$")
DEFAULT_ONLY = re.compile(r"^\(default: .*\)$")  # a config field without a comment


def undocumented(help_text: str) -> list[str]:
    """The arguments in an argparse --help with no help text of their own:
    nothing after the invocation on its line and no deeper-indented line
    after it (argparse puts the help of a long invocation on the next line),
    or only the "(default: ...)" a config flag appends to an empty comment."""
    lines = help_text.splitlines()
    missing, section = [], None
    for i, line in enumerate(lines):
        if HEADING.match(line):
            section = line[:-1]
        elif line and not line.startswith(" "):
            section = None  # the description or an epilog
        elif section is not None and (match := ARGUMENT.match(line)):
            invocation = match["invocation"]
            if invocation.startswith("-h, --help") or not (
                    invocation.startswith("-") or section == "positional arguments"):
                continue
            text = [match["help"] or ""]
            for following in lines[i + 1:]:
                if not following.startswith("   "):
                    break
                text.append(following.strip())
            text = " ".join(text).strip()
            if not text or DEFAULT_ONLY.match(text):
                missing.append(invocation)
    return missing


def test_every_script_flag_has_help():
    env = {**os.environ, "COLUMNS": "80"}
    p = subprocess.run([sys.executable, "-c", GATHER, *SCRIPTS], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout.splitlines()[-1])  # after anything written past sys.stdout
    problems = []
    for script, (code, out, err) in results.items():
        if code != 0 or not out.strip():
            problems.append(f"{script}: --help exited {code} printing {len(out)} characters\n"
                            f"{err[-2000:]}")
            continue
        problems += [f"{script}: {flag}" for flag in undocumented(out)]
    assert not problems, "arguments without help:\n" + "\n".join(problems)
