"""`zero-jax SUBCOMMAND`: the scripts under one command (zero_jax/cli/main.py)."""

import sys

from zero_jax.cli import main as cli


def test_help_lists_each_subcommand_with_its_scripts_first_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"\n  {name} " in out
    assert "Train a model with ZeRO sharding on a device mesh." in out


def test_an_unknown_subcommand_names_the_known_ones(capsys):
    assert cli.main(["trian"]) == 2
    assert "choose from train, plan, memory, export, launch, bench" in capsys.readouterr().err


def test_without_the_scripts_directory_it_says_to_install_from_a_clone(tmp_path):
    message = cli.missing("train", tmp_path / "scripts" / "train.py")
    assert "pip install -e ." in message and "scripts/train.py" in message


def test_a_script_runs_as_main_with_its_arguments(tmp_path, monkeypatch):
    script = tmp_path / "echo.py"
    script.write_text('import sys\nif __name__ == "__main__":\n'
                      '    sys.exit(len(sys.argv[1:]) + 10)\n')
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert cli.run_script(script, ["a", "b"]) == 12
    assert sys.argv == [str(script), "a", "b"]
