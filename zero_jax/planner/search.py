"""The layout search: estimate every choice, compile the best, re-rank.

1. Analytic: one abstract job per mesh, ZeRO stage, stage cut and offload
   (choices.abstract_job); every layout on it estimated (cost.estimate).
2. Compiled: from the top of the ranking down, the layouts that fit, and
   any pinned ones, are compiled on simulated CPU devices (cost.measure)
   in worker processes, each process with the cluster's device count,
   cached on disk by the hash of the run config, the device count, the
   vocabulary and this code. Measured traffic can reorder the ranking, so
   it is redone after each batch and what has risen is compiled next,
   until the rows to be shown are compiled or the budget is spent. An
   offload layout runs the collectives of the same layout without
   offload: that one is compiled.
3. Ranked: fitting first, fastest first, with the compiled figures where
   measured (cost.with_measured).

XLA:CPU compiles at most MAX_CPU_DEVICES devices in one process: larger
clusters are ranked from the estimates alone. `progress(items, desc)` wraps
the loops over layouts (a progress bar); by default it shows nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import hashlib
import importlib.util
import json
import multiprocessing
from pathlib import Path
from typing import Any, Callable, Iterable

from zero_jax import config as config_lib
from zero_jax.planner import cost
from zero_jax.planner.choices import Choice, Cluster, abstract_job

MAX_CPU_DEVICES = 2048  # XLA:CPU: "Multiprocess computations aren't implemented" above this

Progress = Callable[[Iterable, str], Iterable]


def quiet(items: Iterable, desc: str) -> Iterable:
    """The default progress: none."""
    return items


@dataclasses.dataclass(frozen=True)
class Problem:
    """What is planned: the run every layout overrides, its model, the cluster."""

    base: dict[str, Any]  # run-config fields (section.field) shared by every layout
    build: Callable  # models.for_run(...)[0]: devices -> model
    cluster: Cluster
    vocab: int  # the vocabulary for presets without one (the workers build the model again)


def code_version(packages: tuple[str, ...] = ("zero_jax", "models")) -> str:
    """A hash of the packages' source, every subfolder included, so that a
    cached figure is from the code that runs (installed or a source tree)."""
    h = hashlib.sha256()
    for name in packages:
        spec = importlib.util.find_spec(name)
        for root in map(Path, spec.submodule_search_locations or ()):
            for f in sorted(root.rglob("*.py")):
                h.update(f"{name}/{f.relative_to(root).as_posix()}\0".encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:12]


def estimate_all(problem: Problem, layouts: list[Choice],
                 progress: Progress = quiet) -> list[cost.Estimate]:
    """Every layout's estimate, but those whose job the config checks refuse."""
    jobs: dict[tuple, Any] = {}
    rows: dict[int, bool] = {}
    estimates = []
    for choice in progress(layouts, "estimate"):
        key = (choice.pipe, choice.tensor, choice.data, choice.zero, choice.virtual, choice.offload,
               choice.expert, choice.context, choice.quantized)
        if key not in jobs:
            try:
                jobs[key] = abstract_job(choice.flat(problem.base), problem.build,
                                         problem.cluster.size)
            except (ValueError, config_lib.ConfigError) as e:
                jobs[key] = e
        if isinstance(jobs[key], Exception):
            continue
        if choice.tables == "whole" and not _has_row_tables(jobs[key], rows):
            continue  # the same layout as its "rows" twin
        estimates.append(cost.estimate(jobs[key], choice, problem.cluster))
    return estimates


def _has_row_tables(job, known: dict[int, bool]) -> bool:
    """Whether any table of `job` can be used in row blocks (cached by job)."""
    if id(job) not in known:
        known[id(job)] = any(job.row_tables())
    return known[id(job)]


def fitting(estimates: list[cost.Estimate]) -> list[cost.Estimate]:
    """Those that fit, fastest first."""
    return sorted((e for e in estimates if e.fits), key=lambda e: e.time.step_s)


def matching(estimates: list[cost.Estimate], prefixes: list[str]) -> list[cost.Estimate]:
    """Those named by one of `prefixes` (--include): a whole label names its
    layout alone; any other string, every layout whose label starts with it."""
    labels = {e.choice.label for e in estimates}

    def named(label: str, p: str) -> bool:
        return label == p if p in labels else label.startswith(p)

    return [e for e in estimates if any(named(e.choice.label, p) for p in prefixes)]


def compiled_as(choice: Choice) -> Choice:
    """The layout compiled for `choice`'s figures: itself without offload."""
    return dataclasses.replace(choice, offload="")


def rank(estimates: list[cost.Estimate], results: dict, cluster: Cluster) -> list[cost.Estimate]:
    """Estimates with the compiled figures where measured, fitting and fastest first.
    An offload layout takes its twin's collectives, not its memory."""
    out = []
    for e in estimates:
        r = results.get(compiled_as(e.choice))
        if r and "error" not in r:
            e = cost.with_measured(e, r, cluster)
            if e.choice.offload:
                e = dataclasses.replace(
                    e, compiled={k: v for k, v in r.items() if k.startswith("collective")})
        elif r:
            e = dataclasses.replace(e, compiled=r)
        out.append(e)
    return sorted(out, key=lambda e: (not e.fits, e.time.step_s))


def _compile_worker(flat: dict, devices: int, vocab: int) -> dict:
    """In a fresh process: simulate `devices` CPU devices, compile, measure."""
    import jax
    jax.config.update("jax_num_cpu_devices", devices)  # before the backend starts
    import models
    build = models.for_run(config_lib.build(None, flat).model, vocab)[0]
    return cost.measure(flat, build)


def cache_path(cache: Path, flat: dict, devices: int, vocab: int) -> Path:
    key = hashlib.sha256(json.dumps([flat, devices, vocab, code_version()],
                                    sort_keys=True).encode()).hexdigest()[:20]
    return cache / f"{key}.json"


def _store(path: Path, future: cf.Future) -> None:
    """A finished compile's figures into the cache (a failed one is not kept)."""
    if future.exception() is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(future.result()))


def submit(flat: dict, devices: int, vocab: int, cache: Path, pool) -> cf.Future | dict:
    """The cached figures of `flat`, or a future of them compiled in `pool`."""
    path = cache_path(cache, flat, devices, vocab)
    if path.exists():
        return json.loads(path.read_text())
    future = pool.submit(_compile_worker, flat, devices, vocab)
    future.add_done_callback(functools.partial(_store, path))
    return future


def _todo(ranked: list[cost.Estimate], results: dict, top: int, room: int) -> list[Choice]:
    """The next layouts to compile: of the first `top` that fit, as now
    ranked, those not yet compiled, best first, at most `room`."""
    shown = dict.fromkeys(compiled_as(e.choice) for e in ranked if e.fits)
    return [c for c in list(shown)[:top] if c not in results][:room]


def _collect(pending: dict, progress: Progress, desc: str) -> dict:
    """Each layout's figures, or its error's first line."""
    out = {}
    for c in progress(list(pending), desc):
        got = pending[c]
        try:
            out[c] = got.result() if isinstance(got, cf.Future) else got
        except Exception as err:  # noqa: BLE001 - reported in the table
            out[c] = {"error": str(err).splitlines()[0][:200]}
    return out


def compile_best(problem: Problem, estimates: list[cost.Estimate], pinned: list[cost.Estimate], *,
                 count: int, top: int, workers: int, cache_dir: Path,
                 progress: Progress = quiet) -> dict[Choice, dict]:
    """Compiled figures of the top of the ranking as it will be printed, and
    of `pinned`, keyed by the layout compiled (compiled_as).

    Measured traffic moves a layout up or down, so the ranking is redone
    after each batch (one layout per worker) and what rose into the first
    `top` that fit is compiled next: the loop ends when those are all
    compiled or `count` layouts have been (cached ones count too, so a warm
    search prints what a cold one did)."""
    results: dict = {}
    if problem.cluster.size > MAX_CPU_DEVICES or not (count or pinned):
        return results
    n = problem.cluster.size
    ctx = multiprocessing.get_context("spawn")  # a fresh backend per worker, with n devices
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        def run(todo: list[Choice], desc: str) -> None:
            pending = {c: submit(c.flat(problem.base), n, problem.vocab, cache_dir, pool)
                       for c in todo}
            results.update(_collect(pending, progress, desc))

        if pinned:
            run(list(dict.fromkeys(compiled_as(e.choice) for e in pinned)), "compile (--include)")
        spent = 0
        while todo := _todo(rank(estimates, results, problem.cluster), results, top,
                            min(workers, count - spent)):
            run(todo, f"compile {spent + 1}-{spent + len(todo)} of at most {count}")
            spent += len(todo)
    return results


def compiled_top(ranked: list[cost.Estimate], top: int) -> int:
    """How many of the first `top` rows that fit, from the first down, are compiled."""
    shown = [e for e in ranked if e.fits][:top]
    return next((i for i, e in enumerate(shown) if not e.compiled), len(shown))
