"""The paths a run reads or writes only after compiling, checked before:
a typo or a place that cannot be written then costs no compile."""

from __future__ import annotations

import tempfile
from pathlib import Path

from zero_jax.checkpoint import export
from zero_jax.checkpoint.manager import complete_steps


class PathError(ValueError):
    """A path given to a run that it cannot read or write; the message names the flag."""


def _check_init_from(path: Path) -> None:
    """--init-from names one of the three sources its loaders read (their
    own errors then say what inside it is wrong)."""
    what = ("give a checkpoint directory (train.py --checkpoint-dir), a .safetensors file or a "
            "Hugging Face model directory")
    if not path.exists():
        raise PathError(f"--init-from {path}: no such file or directory; {what}")
    if path.is_file() and path.suffix != ".safetensors":
        raise PathError(f"--init-from {path}: a file, but not .safetensors; {what}")
    if path.is_file():
        export.read_header(path)  # a damaged file is named now, not after compiling
    if path.is_dir() and not (complete_steps(path) or (path / "config.json").exists()):
        raise PathError(f"--init-from {path}: holds no complete checkpoint and no Hugging "
                        f"Face config.json; {what}")


def check(run) -> None:
    """Paths the run reads or writes only after compiling: checked now, so
    that a typo costs no compile."""
    c, t = run.checkpoint, run.train
    if c.init_from:
        _check_init_from(Path(c.init_from))
    parent = Path(t.metrics_out).parent
    if t.metrics_out and not parent.is_dir():
        raise PathError(f"--metrics-out {t.metrics_out}: the directory {parent} does not "
                        "exist; create it, or write the metrics elsewhere")
    outputs = {"--checkpoint-dir": c.dir, "--tensorboard-dir": t.tensorboard_dir,
               "--metrics-out": t.metrics_out and str(parent),
               "--profile-dir": t.profile_steps and t.profile_dir}
    for flag, directory in outputs.items():
        if directory and "://" not in directory:  # a remote store (gs://) checks itself
            _check_writable(flag, Path(directory))


def _check_writable(flag: str, directory: Path) -> None:
    """`directory` exists (made now, as the run would make it) and takes a
    file: a run that could not write there would find out only after
    compiling, at its first checkpoint or record."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise PathError(f"{flag} {directory}: cannot write there ({reason}"
                        f"{f': {e.filename}' if e.filename else ''}); give a directory "
                        "this user can create and write") from None
