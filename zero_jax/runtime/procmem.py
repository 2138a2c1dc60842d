"""This process's resident memory, from /proc (Linux): what `zero-jax
export`, `zero-jax prepare-data` and scripts/import_memory.py report their
peaks with."""

from __future__ import annotations

from pathlib import Path


def resident(field: str = "VmRSS") -> int:
    """Bytes of a /proc/self/status field: VmRSS now, VmHWM the peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> int:
    """Reset the peak (VmHWM) to the current resident size; returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return resident("VmRSS")
