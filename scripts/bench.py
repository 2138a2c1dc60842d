"""Throughput, MFU and compiled memory of a fixed suite of training runs.

    python scripts/bench.py --suite cpu                  # 8 simulated CPU devices: under 5 minutes on 2 cores
    python scripts/bench.py --suite gpu-1                # one GPU: bf16, the largest models that fit
    python scripts/bench.py --suite cpu --cases 'gpt-tiny/dp2-*' --steps 5 --json-out b.json
    python scripts/bench.py --suite gpu-1 --dry-run      # the gpu-1 selection on CPU, tiny models

Each case is a run config (model, mesh, ZeRO stage, precision, remat,
offload) prepared as scripts/train.py prepares it. Its train step is compiled
ahead of time (timed: lower + compile), its bytes per device read from the
compiled program's memory_analysis(), its state initialised, and then it runs
--warmup and --steps steps on one synthetic batch, waiting for each.
Reported: tokens/s and model and hardware FLOP/s per device, MFU and HFU at
the median step time (zero_jax/analysis/flops.py; the peak and its source), the step
times' median, quartiles and range, the compile time and the compiled bytes
per device. A case that fails (refused by the config checks, out of memory)
is recorded with its error and the suite goes on. The table is printed as
cases finish, and --json-out is rewritten after each.

--suite gpu-1 climbs ladders of models, smallest first, once per offload mode
(none; the optimizer state in host memory; and at ZeRO-3 the parameters too).
A model whose compiled bytes exceed the device's memory (its bytes_limit, or
--memory-limit), or that runs out of memory, is recorded as "does not fit"
and ends its ladder: the models above it are not tried. JAX's allocator takes
75% of a GPU unless told otherwise: XLA_PYTHON_CLIENT_MEM_FRACTION=.95 lets
larger models fit. Offloaded states that would not fit in the host's memory
end a ladder before compiling. --dry-run climbs the same ladders with tiny
shapes on CPU under a small limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.runtime import cpu
from zero_jax.analysis import flops
from zero_jax.analysis import memory

# The vocabulary of byte-level text (256 bytes and end of document): what
# gpt-tiny and llama-tiny train on in the main job.
BYTE_VOCAB = 257


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    flat: dict  # run config overrides, {"section.field": value}
    ladder: str = ""  # cases of one ladder grow in size: the first that does not fit ends it


def cpu_suite() -> list[Case]:
    """The main job's shape (gpt-tiny, 32 x 128 tokens, fp32) across layouts:
    every ZeRO stage, one device against two and eight, remat, host offload,
    a pipeline, and the Llama family."""
    base = {"model.name": "gpt-tiny", "data.seq_len": 128, "train.batch_size": 32,
            "precision.policy": "fp32", "parallel.zero_stage": 3}
    cases = {
        "gpt-tiny/fsdp8-z3": {"parallel.mesh": "fsdp=8"},
        "gpt-tiny/dp2-fsdp4-z1": {"parallel.mesh": "data=2,fsdp=4", "parallel.zero_stage": 1},
        "gpt-tiny/dp2-fsdp4-z2": {"parallel.mesh": "data=2,fsdp=4", "parallel.zero_stage": 2},
        "gpt-tiny/fsdp1": {"parallel.mesh": "fsdp=1"},
        "gpt-tiny/fsdp2-z3": {"parallel.mesh": "fsdp=2"},
        "gpt-tiny/fsdp8-z3-remat-full": {"parallel.mesh": "fsdp=8", "activations.remat": "full"},
        "gpt-tiny/fsdp8-z2-offload-opt": {"parallel.mesh": "fsdp=8", "parallel.zero_stage": 2,
                                          "offload.optimizer": True},
        "gpt-tiny/pipe2-fsdp4-1f1b": {"parallel.mesh": "pipe=2,fsdp=4", "train.microbatches": 4,
                                      "parallel.pipeline_schedule": "1f1b"},
        "llama-tiny/fsdp8-z3": {"parallel.mesh": "fsdp=8", "model.name": "llama-tiny"},
    }
    return [Case(name, {**base, **flat}) for name, flat in cases.items()]


# Offload modes of the gpu-1 ladders: config overrides. ZeRO-3 throughout:
# on one device it shards nothing, it keeps no bf16 working copy beside the
# float32 parameters (stages 1 and 2 do), and it alone offloads parameters.
OFFLOAD_MODES = {"none": {}, "opt": {"offload.optimizer": True},
                 "opt+params": {"offload.optimizer": True, "offload.params": True}}

# Ladders: family -> rungs, smallest first, each rung (model overrides,
# remat). GPT-2's vocabulary for the GPT presets (which take the data's),
# padded so the head's matmul tiles; full remat from gpt-large (774M) up.
GPT2_VOCAB = {"model.vocab_size": 50257, "model.vocab_multiple": 128}
GPU_LADDERS = {
    "gpt": {"gpt-small": ({"model.name": "gpt-small", **GPT2_VOCAB}, "none"),
            "gpt-medium": ({"model.name": "gpt-medium", **GPT2_VOCAB}, "none"),
            "gpt-large": ({"model.name": "gpt-large", **GPT2_VOCAB}, "full"),
            "gpt-xl": ({"model.name": "gpt-xl", **GPT2_VOCAB}, "full"),
            "gpt-7b": ({"model.name": "gpt-7b", **GPT2_VOCAB}, "full")},
    "llama": {"qwen2-0.5b": ({"model.name": "qwen2-0.5b"}, "none"),
              "llama-3-8b": ({"model.name": "llama-3-8b"}, "full"),
              "llama-2-13b": ({"model.name": "llama-2-13b"}, "full")},
}
# Sequence 1024 (every GPT preset's context), 8 rows per microbatch, two
# microbatches: 16,384 tokens per step.
GPU_BASE = {"data.seq_len": 1024, "train.batch_size": 16, "train.microbatches": 2,
            "precision.policy": "bf16", "parallel.mesh": "fsdp=1", "parallel.zero_stage": 3}

# --dry-run: custom GPTs small enough to compile in seconds on CPU, whose
# compiled bytes grow ~4x a rung, under a limit the third rung exceeds.
DRY_LADDERS = {"dry": {f"dry-d{d}": ({"model.name": "", "model.n_layer": 2, "model.n_head": 4,
                                      "model.d_model": d, "model.vocab_size": BYTE_VOCAB,
                                      "model.max_seq_len": 64}, "none")
                       for d in (64, 128, 512)}}
DRY_BASE = {**GPU_BASE, "data.seq_len": 64, "train.batch_size": 8}
DRY_LIMIT = 32 * 2**20


def gpu_suite(dry_run: bool = False) -> list[Case]:
    """A ladder per model family and offload mode, mode by mode."""
    ladders, base = (DRY_LADDERS, DRY_BASE) if dry_run else (GPU_LADDERS, GPU_BASE)
    return [Case(f"{name}/{mode}", {**base, **model, "activations.remat": remat, **offload},
                 ladder=f"{family}/{mode}")
            for mode, offload in OFFLOAD_MODES.items() for family, rungs in ladders.items()
            for name, (model, remat) in rungs.items()]


SUITES = ("cpu", "gpu-1")
# (timed steps, warm-up steps): the CPU suite's in a few minutes on 2 cores.
DEFAULT_STEPS = {"cpu": (5, 1), "gpu-1": (10, 2)}


def select(cases: list[Case], patterns: str | None) -> list[Case]:
    """The cases whose names match one of the comma-separated shell patterns."""
    if not patterns:
        return cases
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    unmatched = [p for p in wanted if not any(fnmatch.fnmatchcase(c.name, p) for c in cases)]
    if unmatched:
        raise ValueError(f"--cases {','.join(unmatched)}: no such case; choose from "
                         f"{', '.join(c.name for c in cases)}")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in wanted)]


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
    on_host = sum(memory.by_memory_kind(job.layout)["host"].values())
    return on_host + memory.sharded(job.layout)["grads"] if on_host else 0


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


def run_case(case: Case, limit: int | None, warmup: int, steps: int) -> dict:
    """One case's figures; status "ok", "does not fit" or "error"."""
    result = {"name": case.name, "config": case.flat, "status": "error"}
    try:
        job = prepare(case)
        result.update(devices=job.layout.mesh.devices.size, compute_dtype=str(job.policy.compute),
                      params=memory.param_count(job.layout),
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
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return {**result, "status": "does not fit" if out_of_memory(e) else "error",
                "error": f"{type(e).__name__}: {first}"}
    result.update(spread(times))
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_time_s_median"]
    rate = flops.throughput(job)  # over the case's mesh, which may use fewer devices
    result.update(rate.fields(result["tokens_per_s"]), status="ok", steps=steps, warmup=warmup)
    if rate.peak is not None:
        result.update(peak_tflops_per_device=rate.peak.flops / 1e12, peak_source=rate.peak.source)
    return result


def run_suite(cases: list[Case], limit: int | None, warmup: int, steps: int, on_result) -> list[dict]:
    """Every case in order, but none above a rung of its ladder that did not fit."""
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


COLUMNS = (("case", 34), ("params", 9), ("tokens/s", 11), ("MFU", 7), ("HFU", 7),
           ("step ms", 9), ("[min-max]", 15), ("compile s", 10), ("MiB/dev", 9))


def header() -> str:
    return "".join(f"{name:<{w}}" if i == 0 else f"{name:>{w}}" for i, (name, w) in enumerate(COLUMNS))


def row(r: dict) -> str:
    """One case as a table line; a failed case's error in place of figures."""
    name = f"{r['name']:<{COLUMNS[0][1]}}"
    if r["status"] != "ok":
        return f"{name}{r['status']}: {r.get('error', '')}"
    ms = {k: r[f"step_time_s_{k}"] * 1e3 for k in ("median", "min", "max")}
    cells = (f"{r['params'] / 1e6:.1f}M", f"{r['tokens_per_s']:,.0f}",
             *(f"{r[k]:.1%}" if k in r else "-" for k in ("mfu", "hfu")),
             f"{ms['median']:.1f}", f"[{ms['min']:.0f}-{ms['max']:.0f}]", f"{r['compile_s']:.1f}",
             f"{r['memory_bytes_per_device']['total'] / 2**20:,.1f}")
    return name + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS[1:]))


def device_line() -> str:
    d = jax.devices()[0]
    return f"{jax.device_count()} x {d.device_kind} ({d.platform})"


def device_limit() -> int | None:
    """The first device's memory for the program, where the runtime says (GPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def peaks(results: list[dict]) -> dict[str, dict]:
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=SUITES, default="cpu")
    parser.add_argument("--cases", metavar="NAME,...", help="a subset, by name or shell pattern")
    parser.add_argument("--steps", type=int, help="timed steps per case (default: cpu 5, gpu-1 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: cpu 1, gpu-1 2)")
    parser.add_argument("--json-out", type=Path, default=Path("bench.json"), metavar="FILE")
    parser.add_argument("--dry-run", action="store_true",
                        help="gpu-1 only: its ladders with tiny models, runnable on CPU")
    parser.add_argument("--memory-limit", type=int, metavar="BYTES",
                        help="bytes per device a case may use (default: the device's bytes_limit; "
                             f"with --dry-run {DRY_LIMIT})")
    parser.add_argument("--list", action="store_true", help="print the suite's case names and exit")
    cpu.add_devices_flag(parser, default_help="XLA_FLAGS's, else 8 for --suite cpu, 1 for gpu-1")
    args = parser.parse_args(argv)
    steps, warmup = DEFAULT_STEPS[args.suite]
    return argparse.Namespace(**{**vars(args), "steps": steps if args.steps is None else args.steps,
                                 "warmup": warmup if args.warmup is None else args.warmup})


def check(args: argparse.Namespace) -> None:
    """Bad arguments, before anything compiles."""
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: time at least 1 step")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be 0 or more")
    if args.memory_limit is not None and args.memory_limit < 1:
        raise ValueError(f"--memory-limit {args.memory_limit}: give a positive byte count")
    if args.dry_run and args.suite != "gpu-1":
        raise ValueError(f"--dry-run with --suite {args.suite}: only gpu-1 has a dry run")
    if not args.json_out.parent.is_dir():
        raise ValueError(f"--json-out {args.json_out}: no directory {args.json_out.parent}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        check(args)
        cases = select(gpu_suite(args.dry_run) if args.suite == "gpu-1" else cpu_suite(),
                       args.cases)
        if args.list:
            print("\n".join(c.name for c in cases))
            return 0
        # Before anything asks JAX for devices.
        cpu.simulate(args.devices, default=8 if args.suite == "cpu" else 1)
        platform = jax.devices()[0].platform
        if args.suite == "gpu-1" and not args.dry_run and platform != "gpu":
            raise ValueError(f"--suite gpu-1 on {platform}: it needs a GPU; add --dry-run to "
                             "climb its ladders with tiny models here")
    except ValueError as e:  # DevicesError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    limit = args.memory_limit or (DRY_LIMIT if args.dry_run else device_limit())
    started = time.perf_counter()
    print(f"suite {args.suite}{' (dry run)' if args.dry_run else ''} on {device_line()}: "
          f"{len(cases)} case(s), {args.warmup} warm-up + {args.steps} timed steps each"
          + (f", memory limit {limit / 2**30:.3g} GiB per device" if limit else ""), flush=True)
    print(header(), flush=True)

    def on_result(results: list[dict]) -> None:
        print(row(results[-1]), flush=True)
        write_json(args.json_out, args.suite, results)

    results = run_suite(cases, limit, args.warmup, args.steps, on_result)
    ok = sum(r["status"] == "ok" for r in results)
    print(f"{ok} of {len(results)} case(s) ran in {time.perf_counter() - started:.0f} s; "
          f"wrote {args.json_out}")
    for dtype, p in peaks(results).items():
        if p is not None:
            print(f"peak {dtype}: {p['tflops_per_device'] * 1e3:,.1f} GFLOP/s per device ({p['source']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
