"""The host's matmul peak that MFU on CPU devices is taken against: probed,
cached per host, and never taken from a probe that other work slowed down.

A probe times a square matmul, best of several runs. Another process busy on
the same cores slows it (29 GFLOP/s probed beside two busy processes, where a
quiet probe of the same host reads about 170), so each probe also measures
the share of the host's CPU time that went to other processes while it ran:
/proc/stat's busy time less this process's own. The cache keeps, per host,
the probe's figure, its date and that share. An entry probed under load is
probed again by the next run (a quiet probe replaces it; of two loaded ones
the faster stands, as the slower is the one that was slowed), and so is an
entry a run measured more FLOP/s than (`reprobe_next_run`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

PROBE_N = 2048  # large enough to keep every core busy
PROBE_RUNS = 8
QUIET = 0.15  # other processes' share of the host's CPU time below which a probe is quiet


@dataclasses.dataclass(frozen=True)
class Probe:
    """One probe: the host's matmul FLOP/s, when, and under what load."""

    flops: float
    date: str  # UTC, to the minute
    others_busy: float | None  # share of the host's CPU time other processes used (None: unknown)
    reprobe: bool = False  # a run measured more than `flops`: probe again

    @property
    def quiet(self) -> bool:
        return self.others_busy is None or self.others_busy < QUIET

    def describe(self, dtype: str) -> str:
        load = ("" if self.others_busy is None else
                "quiet" if self.quiet else
                f"other processes used {self.others_busy:.0%} of the CPU meanwhile, so the next "
                "run probes again")
        return (f"{self.flops / 1e9:.0f} GFLOP/s measured by a {PROBE_N}^3 {dtype} matmul on "
                f"this host on {self.date}" + (f", {load}" if load else ""))


def peak(dtype: str) -> tuple[Probe, Path]:
    """(this host's probe in `dtype`, the cache file): the cached one, unless
    it is missing, was probed under load or is marked to probe again."""
    key, cache = host_key(dtype), cache_path()
    table = _read_json(cache)
    old = _entry(table.get(key))
    if old is not None and old.quiet and not old.reprobe:
        return old, cache
    new = probe(dtype)
    kept = new if old is None or new.quiet or new.flops >= old.flops else \
        dataclasses.replace(old, reprobe=False)
    table[key] = dataclasses.asdict(kept)
    _write_json(cache, table)
    return kept, cache


def reprobe_next_run(dtype: str) -> None:
    """Mark this host's cached probe to be probed again: a run measured more
    FLOP/s than it, so it is below the host's peak."""
    key, cache = host_key(dtype), cache_path()
    table = _read_json(cache)
    old = _entry(table.get(key))
    if old is not None:
        table[key] = dataclasses.asdict(dataclasses.replace(old, reprobe=True))
        _write_json(cache, table)


def probe(dtype: str) -> Probe:
    a = jnp.ones((PROBE_N, PROBE_N), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    before, start = _cpu_seconds(), time.perf_counter()
    for _ in range(PROBE_RUNS):
        t = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    wall, after = time.perf_counter() - start, _cpu_seconds()
    others = None
    if before is not None and after is not None:
        (host0, own0), (host1, own1) = before, after
        others = max(0.0, ((host1 - host0) - (own1 - own0)) / (wall * (os.cpu_count() or 1)))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return Probe(2 * PROBE_N ** 3 / best, date, others)


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process of the host has been busy, this process's
    own) since boot; None where /proc/stat is not there to read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    own = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def _entry(value) -> Probe | None:
    """A cache entry; an older cache's bare figure, of unknown load and
    date, counts as probed under load (probed again)."""
    if isinstance(value, dict):
        try:
            return Probe(**value)
        except TypeError:
            return None
    if isinstance(value, (int, float)):
        return Probe(float(value), "an unknown date", 1.0)
    return None


def host_key(dtype: str) -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor()} | {os.cpu_count()} cores | jax {jax.__version__} | {dtype}"


def cache_path() -> Path:
    root = os.environ.get("ZERO_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zero_jax")
    return Path(root) / "cpu_peak.json"


def _read_json(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write_json(path: Path, table: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the probe runs again next time
