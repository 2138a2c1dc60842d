"""Step time with the optimizer state (and at ZeRO-3 the parameters) offloaded
to host memory, against the same step without offload.

    python scripts/bench_offload.py --devices 8 --model gpt-small --zero-stage 2
    python scripts/bench_offload.py --devices 8 --model gpt-small --zero-stage 3 \\
        --variants none,opt,opt+params

Runs both in one process on the same devices, their steps interleaved round
by round so that load on a shared machine hits them alike, and prints the
median step time of each, their ratio, and the bytes per device in device
and host memory (from the shardings). On CPU, host and device memory are the
same memory: the ratio measures the transfers and the update run as host
code. On a GPU the same command measures the PCIe or C2C traffic and the
host's update, and `--json` reports the device's peak memory where the
runtime gives it. A variant that does not compile (out of device memory on
a GPU) or is refused (opt+params below ZeRO-3) is reported as such, so one
command shows a model that trains with offload and not without.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.runtime import cpu
import bench_flags
from zero_jax.data import corpus as corpus_lib
from zero_jax.analysis import memory
from timing import interleaved_medians


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_flags.add(parser, model="gpt-tiny", mesh="fsdp=8", zero_stage=2, precision="bf16",
                    seq_len=128, batch_size=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--variants", default="none,opt",
                        help="none, opt (optimizer state), opt+params (ZeRO-3)")
    parser.add_argument("--remat", default="none",
                        help="activation remat: none | full | dots_saveable | save_names | "
                             "offload (default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON, with the device's peak memory, instead of the table")
    cpu.add_devices_flag(parser)
    args = cpu.parse_args(parser, argv)

    corpus = corpus_lib.load("stdlib")
    runs, failed = {}, {}
    for name in args.variants.split(","):
        cfg = config_lib.build(None, {
            "model.name": args.model, "parallel.mesh": args.mesh,
            "parallel.zero_stage": args.zero_stage, "precision.policy": args.precision,
            "data.seq_len": args.seq_len, "train.batch_size": args.batch_size,
            "activations.remat": args.remat, "offload.optimizer": name != "none",
            "offload.params": name == "opt+params"})
        try:
            job = job_lib.prepare(cfg, models.builder(args.model, corpus.vocab_size))
            compiled = job.compile_train_step()
            state = job.init_state()
        except Exception as e:  # noqa: BLE001 - refused, or out of device memory: reported
            failed[name] = str(e).splitlines()[0][:160]
            continue
        batch = functools.partial(corpus_lib.global_batch, corpus, "train", args.seq_len,
                                  args.batch_size, 0, sharding=job.state_plan.batch_sharding)
        runs[name] = {"step": compiled, "state": state, "batch": batch,
                      "bytes": memory.by_memory_kind(job.state_plan),
                      "compiled": memory.compiled(compiled),
                      "tokens": args.batch_size * args.seq_len}

    medians = interleaved_medians(runs, args.steps) if runs else {}
    base = next(iter(medians.values()), None)
    rows = []
    for name, r in runs.items():
        step = medians[name]
        row = {"variant": name, "median_step_s": step, "ratio": step / base,
               "tokens_per_s": r["tokens"] / step,
               "device_bytes": sum(r["bytes"]["device"].values()),
               "host_bytes": sum(r["bytes"]["host"].values()),
               "compiled_temp_bytes": r["compiled"]["temp_bytes"]}
        rows.append(row)
    # The process's peak over every variant run (where the runtime keeps one).
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    if args.json:
        print(json.dumps({"variants": rows, "failed": failed, "device_peak_bytes": peak},
                         indent=1))
    else:
        print(f"{args.model}, {args.mesh}, ZeRO-{args.zero_stage}, {args.precision}, seq "
              f"{args.seq_len}, batch {args.batch_size}, {args.steps} steps each "
              f"({jax.devices()[0].platform})")
        print(f"{'variant':<12}{'step (s)':>10}{'ratio':>8}{'tokens/s':>11}"
              f"{'device MiB':>12}{'host MiB':>10}{'temp MiB':>10}")
        for row in rows:
            print(f"{row['variant']:<12}{row['median_step_s']:>10.3f}{row['ratio']:>8.2f}"
                  f"{row['tokens_per_s']:>11,.0f}{row['device_bytes'] / 2**20:>12.1f}"
                  f"{row['host_bytes'] / 2**20:>10.1f}"
                  f"{row['compiled_temp_bytes'] / 2**20:>10.1f}")
        for name, why in failed.items():
            print(f"{name:<12}failed: {why}")
        if peak is not None:
            print(f"device peak over all variants: {peak / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
