"""What --init-from names, looked inside before compiling: a safetensors
file's header read, a directory's complete checkpoints or Hugging Face
config.json found. (config/paths.py has checked that it exists and is of a
kind the loaders take.)"""

from __future__ import annotations

from pathlib import Path

from zero_jax.checkpoint import export
from zero_jax.checkpoint.manager import complete_steps
from zero_jax.config.paths import INIT_FROM, PathError


def check_init_from(init_from: str) -> None:
    """A damaged file or a directory holding nothing to load is named now,
    not after compiling."""
    if not init_from:
        return
    path = Path(init_from)
    if path.is_file():
        export.read_header(path)
    if path.is_dir() and not (complete_steps(path) or (path / "config.json").exists()):
        raise PathError(f"--init-from {path}: holds no complete checkpoint and no Hugging "
                        f"Face config.json; {INIT_FROM}")
