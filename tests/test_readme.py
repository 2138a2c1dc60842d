"""Every ```sh block of README.md and of docs/*.md runs as written, shortened.

Each block runs in a fresh directory of its own that links the repository's
scripts/, zero_jax/, models/, meshes/ and .venv, so the pages' relative
paths work and what the commands write (ckpt/, data/, metrics.jsonl) stays
there; the commands of one block run in order in that directory, later ones
reading what earlier ones wrote. A command passes when it exits 0.

Shortening is the table SHORTEN below: per program, flags set to a value (the
block's value replaced, or the flag appended). Training runs have their step
counts cut 100-fold (--steps, --stop-at and --checkpoint-every keep their
order), sequences of 32 tokens and one validation batch, at the end, and a
profile of step 1; memory reports use sequences of 64; the planner searches
the layouts around the block's --include and compiles none; the benchmark
runs one case for two steps, and the step anatomy traces one. What a command shows (the mesh, the
schedule, the checkpoint round trip) stays; its length goes. A block added
to the README or a docs page needs a row here only if its program is new
and slow. A test's id names the file, the block's place in it and the
section above it (`docs-pipelines-0-run-a-pipeline`).

Not run: blocks holding the line `# needs: a cluster` (srun, gcloud; at most
MAX_CLUSTER_BLOCKS in all the files), and `make train` and `make test` in the
README's first block (the 4-minute job, and this suite itself). Run only
under ZERO_JAX_FULL_GRID=1, for the suite's time: the slowest docs blocks
(FULL_ONLY), whose commands CI runs in their own tests (named there). The device
count is the commands' own business: the test removes the suite's forced 8
devices from XLA_FLAGS, so a command that does not ask for devices
(`--devices 8`) gets one and fails as a user's would.
"""

from __future__ import annotations

import math
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_jax.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))  # one page per task, run like the README
CLUSTER = "# needs: a cluster"
MAX_CLUSTER_BLOCKS = 3
NOT_RUN = {"make train", "make test"}  # the 4-minute job; the suite this test is part of
FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
FULL_ONLY = {  # block id -> the tests that run its commands in CI
    "docs-planning-0-plan-a-run": "test_planner.py (BLOOM's layout, plan.py's ranking and config)",
    "docs-pipelines-0-run-a-pipeline": "test_scripts.py::test_pipelined_training_runs_and_prints_its_stages",
    "docs-parallelism-0-activation-checkpointing": "test_scripts.py::test_memory_report_remat_table",
    "docs-models-1-fine-tune-a-hugging-face-checkpoint": "test_llama.py (Hugging Face weights)",
    "docs-offload-0-the-optimizer-on-the-host": "test_offload.py",
    "docs-hosts-0-several-processes-on-one-machine":
        "test_multiprocess.py::test_processes_give_the_losses_of_one_process[2x4-cpu-2x4]",
}
LINKED = ("scripts", "zero_jax", "models", "meshes")  # .venv: the interpreter's own, below
SUBCOMMANDS = {name: Path(script).stem for name, script in cli.COMMANDS.items()}  # zero-jax's


def scaled(value: str | None) -> str:
    """A step count cut 100-fold, at least 1; 0 (off) stays 0. Absent:
    train.py's 300 steps, cut the same way."""
    n = 300 if value is None else int(value)
    return str(n and max(1, math.ceil(n / 100)))


def cut_if_given(value: str | None) -> str | None:
    return None if value is None else scaled(value)


SWITCH = object()  # a flag without a value, appended when absent

# program (a script's name) -> {flag: a value, or a function of the README's
# value (None when absent) returning the new one (None: leave it out)}.
TRAIN = {"--steps": scaled, "--stop-at": cut_if_given, "--checkpoint-every": cut_if_given,
         "--keep-every": cut_if_given, "--eval-every": lambda v: "0" if v is None else scaled(v),
         "--eval-batches": "1", "--seq-len": "32", "--no-progress": SWITCH,
         "--profile-steps": lambda v: None if v is None else "1:2"}
SHORTEN: dict[str, dict[str, object]] = {
    "train": TRAIN,
    # one case of the suite, two timed steps
    "bench": {"--cases": "gpt-tiny/fsdp2-z3", "--steps": "2", "--warmup": "1"},
    "anatomy": {"--seq-len": "32", "--trace-steps": "1"},
    "memory_report": {"--seq-len": "64"},
    # the search narrowed to the layouts of the README's --include, nothing compiled
    "plan": {"--compile": "0", "--micro": "2", "--stages": "1", "--remat": "full",
             "--offload": "none", "--tables": "whole"},
}


# -- reading the README and the docs ---------------------------------------

def sh_blocks(text: str) -> list[tuple[str, str]]:
    """(the section heading above it, its text) for every ```sh block."""
    blocks, heading = [], "top"
    for part in re.split(r"^(```sh\n.*?^```)$", text, flags=re.M | re.S):
        if part.startswith("```sh"):
            blocks.append((heading, part[len("```sh\n"):-len("```")]))
        else:
            headings = re.findall(r"^#+ (.+)$", part, flags=re.M)
            heading = headings[-1] if headings else heading
    return blocks


def commands(block: str) -> list[str]:
    """Its shell commands, without comments; continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.join(shlex.split(line, comments=True)) for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def runnable(block: str) -> list[str]:
    return [c for c in commands(block) if c not in NOT_RUN]


# -- shortening --------------------------------------------------------------

def program(token: str, previous: str | None) -> str | None:
    """The script a token starts, if it starts one: scripts/NAME.py, or a
    subcommand of zero-jax."""
    if m := re.fullmatch(r"(?:.*/)?scripts/(\w+)\.py", token):
        return m.group(1)
    if previous is not None and previous.endswith("zero-jax"):
        return SUBCOMMANDS.get(token)
    return None


def set_flag(args: list[str], flag: str, rule) -> list[str]:
    """`args` with `flag` set by `rule` (see SHORTEN)."""
    args = list(args)
    end = args.index("--") if "--" in args else len(args)  # after --: another program's flags
    where = [i for i, a in enumerate(args[:end]) if a == flag]
    if rule is SWITCH:
        return args if where else args[:end] + [flag] + args[end:]
    given = args[where[-1] + 1] if where else None
    value = rule(given) if callable(rule) else rule
    if value is None:
        return args
    if where:
        args[where[-1] + 1] = value
        return args
    return args[:end] + [flag, value] + args[end:]


def programs(tokens: list[str]) -> list[tuple[int, str]]:
    """(position, script name) of each program in a command (launch.py starts
    another one after its --)."""
    named = [(i, program(t, tokens[i - 1] if i else None)) for i, t in enumerate(tokens)]
    return [(i, name) for i, name in named if name]


def shorten(command: str) -> str:
    """The command with each program's flags set by SHORTEN."""
    tokens = shlex.split(command)
    found = programs(tokens)
    ends = [i for i, _ in found[1:]] + [len(tokens)]
    out = tokens[:found[0][0]] if found else tokens
    for (start, name), end in zip(found, ends):
        args = tokens[start + 1:end]
        for flag, rule in SHORTEN.get(name, {}).items():
            args = set_flag(args, flag, rule)
        out += [tokens[start], *args]
    return shlex.join(out)


# -- running -----------------------------------------------------------------

def environment(cache: Path) -> dict[str, str]:
    """This process's environment, less the forced device count, with a
    compilation cache shared by every command (most compile the same steps)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_JAX_")}
    return {**env, "XLA_FLAGS": " ".join(flags), "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "PYTHONUNBUFFERED": "1"}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def workdir(path: Path) -> Path:
    path.mkdir()
    for name in LINKED:
        (path / name).symlink_to(ROOT / name)
    (path / ".venv").symlink_to(Path(sys.prefix))  # the environment running these tests
    return path


def slug(text: str) -> str:
    return re.sub(r"[^a-z]+", "-", text.lower()).strip("-")


def file_blocks(path: Path) -> list[tuple[str, str, str]]:
    """(a test id, the section heading above it, its text) for every ```sh
    block of one file; the id names the file, the block's place and section."""
    name = slug(str(path.relative_to(ROOT).with_suffix("")))
    return [(f"{name}-{i}-{slug(heading)}", heading, block)
            for i, (heading, block) in enumerate(sh_blocks(path.read_text()))]


BLOCKS = [b for path in [README, *DOCS] for b in file_blocks(path)]  # the README's first
RUN = [b for b in BLOCKS if CLUSTER not in b[2] and runnable(b[2])]
SAMPLED = RUN if FULL else [b for b in RUN if b[0] not in FULL_ONLY]
# The README's blocks run here, the docs pages' in test_docs_blocks.py: two
# files, which the suite's workers take in parallel.
README_RUN = [b for b in SAMPLED if b[0].startswith("readme-")]
DOCS_RUN = [b for b in SAMPLED if not b[0].startswith("readme-")]


def test_the_readme_has_runnable_blocks_and_few_cluster_ones():
    cluster = [b for _, _, b in BLOCKS if CLUSTER in b]
    assert 0 < len(cluster) <= MAX_CLUSTER_BLOCKS, [b.splitlines()[0] for b in cluster]
    assert BLOCKS[0][0].startswith("readme-")
    assert set(commands(BLOCKS[0][2])) == NOT_RUN  # the headline block; nothing else is left out
    assert len(RUN) == len(BLOCKS) - len(cluster) - 1


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("readme_jax_cache")


def test_the_full_only_blocks_exist():
    assert set(FULL_ONLY) <= {i for i, _, _ in RUN}


@pytest.mark.parametrize("heading,block", [(h, b) for _, h, b in README_RUN],
                         ids=[i for i, _, _ in README_RUN])
def test_readme_block_runs(heading, block, cache, tmp_path):
    run_block(heading, block, cache, tmp_path)


def run_block(heading: str, block: str, cache: Path, tmp_path: Path) -> None:
    """Each command of `block`, shortened, in a fresh directory; each must exit 0."""
    cwd, env = workdir(tmp_path / "repo"), environment(cache)
    for command in runnable(block):
        short = shorten(command)
        start, cpu = time.perf_counter(), cpu_seconds()
        p = subprocess.run(["bash", "-c", short], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=600)
        # Shown with -s: what each command costs, to keep this test's time in check.
        print(f"{time.perf_counter() - start:6.1f} s, {cpu_seconds() - cpu:6.1f} s of CPU  {short}")
        assert p.returncode == 0, (f"{heading}: {short}\nexit {p.returncode}\n"
                                   f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def test_shortening_reaches_the_program_after_launchers_double_dash():
    command = ".venv/bin/python scripts/launch.py -n 2 -- scripts/train.py --steps 500 --stop-at 200"
    assert shorten(command) == (
        ".venv/bin/python scripts/launch.py -n 2 -- scripts/train.py --steps 5 --stop-at 2 "
        "--eval-every 0 --eval-batches 1 --seq-len 32 --no-progress")
    assert shorten(".venv/bin/zero-jax plan --compile 4") == (
        ".venv/bin/zero-jax plan --compile 0 --micro 2 --stages 1 --remat full --offload none "
        "--tables whole")
