"""Step timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax


def interleaved_medians(runs: dict, steps: int) -> dict[str, float]:
    """Median step time of each run, their steps interleaved round by round
    so that load on a shared machine hits them alike (round 0 warms up and
    is not timed). A run is {"step": compiled step, "state": its state,
    "batch": step index -> batch}; its state is advanced in place."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(steps + 1):
        for name, r in runs.items():
            start = time.perf_counter()
            r["state"], metrics = r["step"](r["state"], r["batch"](step=i))
            jax.block_until_ready(metrics)
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
