"""One benchmark case compiled, run and timed; a suite of them in order.

A case's job is prepared as `zero-jax train` prepares its run, on the first
devices its mesh needs. Its train step is compiled ahead of time (timed:
lower + compile), its bytes per device read from the compiled program's
memory_analysis(), its state initialised, and then it runs `warmup` and
`steps` steps on one synthetic batch, waiting for each. Figures: tokens/s
and model and hardware FLOP/s per device, MFU and HFU at the median step
time (analysis/flops.py), the step times' median, quartiles and range, the
compile time and the compiled bytes. A case that fails (refused by the
config checks, out of memory) is a result with its error: the suite goes on.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import flops, memory
from zero_jax.bench.suites import BYTE_VOCAB, Case
from zero_jax.runtime import cpu


def prepare(case: Case) -> job_lib.Job:
    """The case's job on the first devices its mesh needs (a case may use
    fewer than the process has)."""
    run = config_lib.build(None, case.flat)
    needed = job_lib.mesh_config(run).fixed_devices
    if needed > jax.device_count():
        raise config_lib.ConfigError(f"mesh {run.parallel.mesh} needs {needed} devices, "
                                     f"{jax.device_count()} present; {cpu.fix_hint(needed)}")
    vocab = run.model.vocab_size or models.preset_vocab(run.model.name) or BYTE_VOCAB
    build, _ = models.for_run(run.model, vocab)
    return job_lib.prepare(run, build, jax.devices()[:needed])


def synthetic_batch(job: job_lib.Job, seed: int = 0) -> dict[str, jax.Array]:
    """A batch shaped as job.abstract_batch: random token ids, every target
    weighted 1 / (B T) (a batch with nothing masked). Random ids rather than a
    corpus: reading data is not what is measured, and none needs a tokenizer."""
    abstract = job.abstract_batch
    B, T1 = abstract["tokens"].shape
    rng = np.random.default_rng(seed)
    host = {"tokens": rng.integers(0, job.model.config.vocab_size, (B, T1), dtype=np.int32),
            "weights": np.full((B, T1 - 1), 1 / (B * (T1 - 1)), np.float32)}
    return {k: jax.device_put(v, abstract[k].sharding) for k, v in host.items()}


def compiled_bytes(compiled) -> dict[str, int]:
    """Bytes per device of the compiled step (memory_analysis()). Donated
    arguments alias outputs and are counted once; "host" is what a backend
    that separates memory spaces places in host memory (offload)."""
    m = compiled.memory_analysis()
    size = {name: int(getattr(m, f"{name}_size_in_bytes", 0) or 0) for name in (
        "argument", "output", "temp", "alias", "generated_code",
        "host_argument", "host_output", "host_temp", "host_alias")}
    return {"arguments": size["argument"], "outputs": size["output"], "temp": size["temp"],
            "alias": size["alias"], "generated_code": size["generated_code"],
            "total": (size["argument"] + size["output"] - size["alias"] + size["temp"]
                      + size["generated_code"]),
            "host": (size["host_argument"] + size["host_output"] - size["host_alias"]
                     + size["host_temp"])}


def host_bytes(job: job_lib.Job) -> int:
    """Host memory the offloaded states take, with the gradients copied there
    for the update (0 without offload). Checked before compiling: running out
    of host memory kills the process, where running out of device memory
    only fails the case."""
    on_host = sum(memory.by_memory_kind(job.state_plan)["host"].values())
    return on_host + memory.sharded(job.state_plan)["grads"] if on_host else 0


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def timed_steps(compiled, state, batch, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` steps after `warmup`, each waited for (the
    whole state, not only the metrics: no step overlaps the next)."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def spread(times: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
    return {"step_time_s_median": statistics.median(times), "step_time_s_min": min(times),
            "step_time_s_max": max(times), "step_time_s_q1": q1, "step_time_s_q3": q3}


def out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _failed(result: dict, e: Exception) -> dict:
    """`result` as a case that failed with `e`, its first line kept."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return {**result, "status": "does not fit" if out_of_memory(e) else "error",
            "error": f"{type(e).__name__}: {first}"}


def _rates(result: dict, job: job_lib.Job, times: list[float], warmup: int, steps: int) -> dict:
    """`result` with the timed steps' spread and the rates at their median."""
    result = {**result, **spread(times)}
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_time_s_median"]
    rate = flops.throughput(job)  # over the case's mesh, which may use fewer devices
    result.update(rate.fields(result["tokens_per_s"]), status="ok", steps=steps, warmup=warmup)
    if rate.peak is not None:
        result.update(peak_tflops_per_device=rate.peak.flops / 1e12, peak_source=rate.peak.source)
    return result


def run_case(case: Case, limit: int | None, warmup: int, steps: int) -> dict:
    """One case's figures; status "ok", "does not fit" or "error"."""
    result = {"name": case.name, "config": case.flat, "status": "error"}
    try:
        job = prepare(case)
        result.update(devices=job.state_plan.mesh.devices.size, compute_dtype=str(job.policy.compute),
                      params=memory.param_count(job.state_plan),
                      tokens_per_step=job.run.train.batch_size * job.run.data.seq_len)
        needs_host = host_bytes(job)
        if needs_host > host_memory():
            return {**result, "status": "does not fit",
                    "error": f"offloaded states need {needs_host / 2**30:.1f} GiB of host memory, "
                             f"the host has {host_memory() / 2**30:.1f} GiB"}
        start = time.perf_counter()
        compiled = job.lower_train_step().compile()
        result["compile_s"] = time.perf_counter() - start
        result["memory_bytes_per_device"] = used = compiled_bytes(compiled)
        if limit is not None and used["total"] > limit:
            return {**result, "status": "does not fit",
                    "error": f"compiled step needs {used['total'] / 2**30:.2f} GiB per device, "
                             f"the limit is {limit / 2**30:.2f} GiB"}
        times = timed_steps(compiled, job.init_state(), synthetic_batch(job), warmup, steps)
    except Exception as e:  # noqa: BLE001 - refused, out of memory, broken: recorded, suite goes on
        return _failed(result, e)
    return _rates(result, job, times, warmup, steps)


def run_suite(cases: list[Case], limit: int | None, warmup: int, steps: int,
              on_result: Callable[[list[dict]], None]) -> list[dict]:
    """Every case in order, but none above a rung of its ladder that did not
    fit; `on_result` sees the results so far after each case."""
    results, ended = [], set()
    for case in cases:
        if case.ladder in ended:
            continue
        result = run_case(case, limit, warmup, steps)
        results.append(result)
        on_result(results)
        if case.ladder and result["status"] == "does not fit":
            ended.add(case.ladder)
        gc.collect()  # the case's state and program, before the next allocates
    return results


def device_line() -> str:
    d = jax.devices()[0]
    return f"{jax.device_count()} x {d.device_kind} ({d.platform})"


def device_limit() -> int | None:
    """The first device's memory for the program, where the runtime says (GPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def peaks(results: list[dict]) -> dict[str, dict | None]:
    """The device's peak per device for each compute dtype the cases ran in."""
    out = {}
    for dtype in sorted({r["compute_dtype"] for r in results if "compute_dtype" in r}):
        p = flops.device_peak(jax.devices()[0], dtype)
        out[dtype] = None if p is None else {"tflops_per_device": p.flops / 1e12, "source": p.source}
    return out


def write_json(path: Path, suite: str, results: list[dict]) -> None:
    doc = {"suite": suite, "device": device_line(), "peak": peaks(results), "cases": results}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
