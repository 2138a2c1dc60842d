"""Outputs written under temporary names beside their destinations, then
renamed into place together (`zero-jax export`): a failure half-way leaves
what the user had as it was, and a directory replaced is swapped in by
renames, never left half-written under the user's name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class Staged:
    """Outputs written under temporary names beside their destinations (the
    same file system, so that a rename moves them), then renamed into place
    together; `writing` is the destination being written (for an error)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Path, Path]] = []  # (temporary, destination)
        self.writing: Path | None = None
        self.committed: list[Path] = []  # renamed into place before a failure

    def file(self, destination: str) -> Path:
        return self._add(real(destination))

    def directory(self, destination: str) -> Path:
        final = real(destination)
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = self._add(final)
        temporary.mkdir()
        return temporary

    def _add(self, final: Path) -> Path:
        temporary = final.with_name(f".{final.name}.partial-{os.getpid()}")
        self.pairs.append((temporary, final))
        self.writing = final
        return temporary

    def discard(self) -> None:
        for temporary, _ in self.pairs:
            if temporary.is_dir() and not temporary.is_symlink():
                shutil.rmtree(temporary, ignore_errors=True)
            else:
                temporary.unlink(missing_ok=True)

    def commit(self) -> list[str]:
        """Each output renamed into place; notes of old directories left behind."""
        notes = []
        for temporary, final in self.pairs:
            self.writing = final
            if temporary.is_dir():
                notes += _swap_in(temporary, final)
            else:
                os.replace(temporary, final)
            self.committed.append(final)
        return notes


def real(path: str) -> Path:
    """The path a destination names, links followed: a link stays, and what
    it points to is replaced."""
    return Path(os.path.realpath(path))


def _swap_in(temporary: Path, final: Path) -> list[str]:
    """Directory `temporary` renamed to `final`: at once where `final` is
    absent or empty, else by moving the old one aside first (put back if
    the second rename fails) and removing it after."""
    if not final.exists() or (final.is_dir() and not any(final.iterdir())):
        os.replace(temporary, final)
        return []
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.rename(final, old)
    try:
        os.rename(temporary, final)
    except OSError:
        os.rename(old, final)
        raise
    try:
        shutil.rmtree(old)
    except OSError as e:
        return [f"note: the replaced {final} is left at {old} ({e.strerror}); remove it"]
    return []
