"""The paths a run reads or writes only after compiling, checked before:
a typo or a place that cannot be written then costs no compile."""

from __future__ import annotations

import tempfile
from pathlib import Path



class PathError(ValueError):
    """A path given to a run that it cannot read or write; the message names the flag."""


# What --init-from takes; checkpoint/sources.py reads inside it.
INIT_FROM = ("give a checkpoint directory (zero-jax train --checkpoint-dir), a .safetensors "
             "file or a Hugging Face model directory")


def _check_init_from(path: Path) -> None:
    """--init-from names a file or directory of a kind its loaders read
    (checkpoint/sources.py then looks inside, and their own errors say what
    inside it is wrong)."""
    if not path.exists():
        raise PathError(f"--init-from {path}: no such file or directory; {INIT_FROM}")
    if path.is_file() and path.suffix != ".safetensors":
        raise PathError(f"--init-from {path}: a file, but not .safetensors; {INIT_FROM}")


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
