"""This process's resident memory, from /proc (Linux): what `zero-jax
export`, `zero-jax prepare-data` and the import benchmark report their
peaks with; and the memory still free for it to take, which `zero-jax
train` checks a model's states against before allocating them."""

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


def available(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
              ) -> tuple[int, str] | None:
    """(bytes, where the figure is from) of memory this process can still
    take: /proc/meminfo's MemAvailable, or what its cgroups' limits leave
    (limit less usage, less the reclaimable page cache) where that is lower.
    None where neither can be read (not Linux)."""
    found = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except OSError:
        pass
    found += _cgroup_room(proc, cgroup_root)
    return min(found) if found else None


# Beyond this a cgroup's "limit" is no limit (cgroup v1 writes 2^63 less a page).
_NO_LIMIT = 1 << 60


def _cgroup_room(proc: Path, root: Path) -> list[tuple[int, str]]:
    """(limit - usage + inactive page cache, the cgroup) for each of this
    process's cgroups, and their parents, that has a memory limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            base = root / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        here = base / path.lstrip("/")
        if not here.is_dir():  # a cgroup namespace: the mount is the process's own cgroup
            here = base
        while True:
            room = _room(here, *files)
            if room is not None:
                out.append((room, f"the memory limit of cgroup {here}"))
            if here == base or base not in here.parents:
                break
            here = here.parent
    return out


def _room(directory: Path, limit_file: str, usage_file: str, inactive: str) -> int | None:
    try:
        limit = (directory / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= _NO_LIMIT:
            return None
        usage = int((directory / usage_file).read_text())
        cache = 0
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive:
                cache = int(value)
        return max(int(limit) - usage + cache, 0)
    except (OSError, ValueError):
        return None
