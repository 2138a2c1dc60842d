"""`zero-jax SUBCOMMAND`: one module of zero_jax/cli/ per subcommand
(zero_jax/cli/main.py), the same commands as scripts/*.py, and a built
wheel that runs them without the source tree."""

import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zero_jax.cli import launch
from zero_jax.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
# Environment of a command run as a user would: no forced devices, no launcher.
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("ZERO_JAX_")}


def test_help_lists_each_subcommand_with_its_modules_first_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"\n  {name} " in out
    assert "Train a model with ZeRO sharding on a device mesh." in out


def test_help_imports_no_jax():
    """The summaries are read from the modules' files: JAX takes seconds to start."""
    code = ("import sys; from zero_jax.cli import main; main.usage(); "
            "sys.exit(any(m == 'jax' or m.startswith('jax.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], env=ENV, timeout=60).returncode == 0


def test_an_unknown_subcommand_names_the_known_ones(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "choose from train, plan, memory, export, launch, bench, prepare-data" in err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize("stem", sorted(set(cli.COMMANDS.values())))
def test_each_script_is_a_shim_over_its_module(stem):
    """scripts/<stem>.py imports the module's main and runs it: nothing else."""
    module = importlib.import_module(f"zero_jax.cli.{stem}")
    assert callable(module.main) and ast.get_docstring(ast.parse(Path(module.__file__).read_text()))
    tree = ast.parse((ROOT / "scripts" / f"{stem}.py").read_text())
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert [(n.module, [a.name for a in n.names]) for n in imports] == [(f"zero_jax.cli.{stem}",
                                                                        ["main"])]
    assert f"zero_jax/cli/{stem}.py" in ast.get_docstring(tree)


def test_a_subcommand_gets_its_arguments_and_its_name_in_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["prepare-data", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: zero-jax prepare-data ") and "--val-fraction" in out


def test_launch_runs_zero_jax_with_this_interpreter(monkeypatch):
    """`-- zero-jax ...` needs no zero-jax on PATH: it is this install's `python -m zero_jax`."""
    monkeypatch.setenv("PATH", "")
    args = launch.parse(["-n", "2", "--", "zero-jax", "train", "--steps", "3"])
    assert launch.checked_command(args) == [sys.executable, "-m", "zero_jax", "train",
                                            "--steps", "3"]


def test_launch_starts_zero_jax_in_every_process():
    p = subprocess.run([sys.executable, "-m", "zero_jax", "launch", "-n", "2", "--", "zero-jax",
                        "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for i in range(2):
        assert f"[{i}] usage: zero-jax SUBCOMMAND" in p.stdout
        assert f"[{i}]   prepare-data " in p.stdout


def test_launch_pin_cores_gives_each_process_a_core_of_its_own():
    """--pin-cores: process i runs on core i of the launcher's, alone; more
    processes than cores is refused before any starts."""
    cores = sorted(os.sched_getaffinity(0))
    n = min(2, len(cores))
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    p = subprocess.run([sys.executable, "-m", "zero_jax", "launch", "-n", str(n), "--pin-cores",
                        "--", sys.executable, "-c", show], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    for i in range(n):
        assert f"[{i}] [{cores[i]}]" in p.stdout, p.stdout
    with pytest.raises(ValueError, match=f"--pin-cores: {len(cores) + 1} processes, but only "
                                         f"{len(cores)} cores"):
        launch.checked_command(launch.parse(["-n", str(len(cores) + 1), "--pin-cores", "--",
                                             sys.executable, "-c", show]))


# -- the built wheel, installed away from the source tree ------------------

SOURCES = ("pyproject.toml", "README.md", "zero_jax", "models", "meshes")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (a build in the tree would
    leave build/ there), installed with `pip install --target`: the folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", tmp / "dist", src], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = (tmp / "dist").glob("zero_jax-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", tmp / "site", wheel], check=True,
                   timeout=300, capture_output=True)
    return tmp / "site"


def run_installed(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`zero-jax argv...` from `site` only: it is first on sys.path, and the
    command fails unless zero_jax, models and the mesh configs come from it."""
    code = (f"import sys; sys.path.insert(0, {str(site)!r})\n"
            "import models, zero_jax\n"
            "from zero_jax.sharding import mesh\n"
            "for where in (zero_jax.__file__, models.__file__, mesh.MESHES):\n"
            f"    assert str(where).startswith({str(site)!r}), where\n"
            "from zero_jax.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_the_commands_and_the_mesh_configs(installed):
    assert (installed / "zero_jax" / "cli" / "train.py").is_file()
    assert (installed / "zero_jax" / "meshes" / "cpu-8.toml").is_file()
    assert (installed / "zero_jax" / "meshes" / "devices" / "a100-80gb.toml").is_file()
    assert not (installed / "scripts").exists()


def test_the_installed_command_runs_outside_the_source_tree(installed, tmp_path):
    p = run_installed(installed, tmp_path, "train", "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: zero-jax train ") and "--zero-stage" in p.stdout
    p = run_installed(installed, tmp_path, "memory", "--model", "gpt-tiny", "--mesh", "cpu-8",
                      "--no-compile", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)  # cpu-8.toml read from the install: 8-way ZeRO-3
    assert report["sharded_bytes"]["params"] < report["param_count"] * 4 / 7
