"""Step time of each pipeline schedule against the non-pipelined step.

    python scripts/bench_pipeline.py --devices 8 --mesh pipe=2,fsdp=4 --microbatches 8
    python scripts/bench_pipeline.py --pinned --d-model 384

Runs, in one process and on the same devices: the non-pipelined step (the
`pipe` axis folded into `fsdp`, the same microbatches accumulated) and each
schedule (or those `--schedules` names) on the given mesh. Steps of the
variants are interleaved, round by round, so that load on a shared machine
hits them alike; the table gives the median step time of each and its ratio
to the non-pipelined one. A benchmark, not a test.

With simulated devices sharing cores, a device waiting for a neighbour
lends its core to another, which hides a schedule's idle time. `--pinned`
runs `pipe=2` as 2 processes of 1 device each, each pinned to its own core
(`launch --pin-cores`), where waiting costs what it costs on a cluster. It
reports each schedule against gpipe and against its ideal: one device's
time for the whole batch (measured on each process's own device, both at
once), halved, and stretched by the schedule's idle fraction
(schedule.cost, with the model's cut and head).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import os

import jax

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.cli import launch
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.runtime import cpu, distributed
from zero_jax.data import corpus as corpus_lib
from zero_jax.sharding import mesh as mesh_lib
from zero_jax.pipeline.schedule import SCHEDULES
from timing import interleaved_medians


def _without_pipe(mesh: str) -> str:
    """The mesh with `pipe` folded into `fsdp`, inline: the same devices, no stages."""
    sizes = dict(zip(mesh_lib.AXES, mesh_lib.load(mesh).ici))
    sizes["fsdp"] *= sizes.pop("pipe")
    return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "fsdp=1"


def prepare(args, corpus, mesh: str, schedule: str, devices=None) -> job_lib.Job:
    shape = {f"model.{k}": getattr(args, k) for k in ("d_model", "n_layer") if getattr(args, k)}
    cfg = config_lib.build(None, {
        "model.name": args.model, "parallel.mesh": mesh, "parallel.zero_stage": args.zero_stage,
        "parallel.pipeline_schedule": schedule, "train.microbatches": args.microbatches,
        "data.seq_len": args.seq_len, "train.batch_size": args.batch_size, **shape})
    return job_lib.prepare(cfg, models.for_run(cfg.model, corpus.vocab_size)[0], devices)


def _run(job: job_lib.Job, corpus, args, mesh: str) -> dict:
    batch = functools.partial(corpus_lib.global_batch, corpus, "train", args.seq_len,
                              args.batch_size, 0, sharding=job.state_plan.batch_sharding)
    return {"mesh": mesh, "step": job.compile_train_step(), "state": job.init_state(),
            "batch": batch}


def pinned(args, argv: list[str]) -> int:
    """This script again, as 2 processes of 1 device pinned to a core each."""
    if os.environ.get(distributed.ENV_PROCESS_ID) is None:
        return launch.main(["-n", "2", "--devices-per-process", "1", "--pin-cores", "--",
                            __file__, *argv])
    distributed.initialize(config_lib.DistributedConfig())
    corpus = corpus_lib.load("stdlib")
    schedules = args.schedules.split(",")
    jobs = {name: prepare(args, corpus, "pipe=2", name) for name in schedules}
    runs = {"one device": _run(prepare(args, corpus, "fsdp=1", "1f1b", jax.local_devices()[:1]),
                               corpus, args, "fsdp=1")}
    runs.update({name: _run(job, corpus, args, "pipe=2") for name, job in jobs.items()})
    medians = interleaved_medians(runs, args.steps)
    if jax.process_index() != 0:
        return 0
    one = medians["one device"]
    rows = []
    for name, job in jobs.items():
        head = job.model.head_cost(args.seq_len) if job.model.head_cost else 0.0
        idle = schedule_lib.cost(job.schedule, job.state_plan.stages.counts,
                              schedule_lib.Prices(head=head)).bubble
        ideal = one / 2 / (1 - idle)
        rows.append({"schedule": name, "median_step_s": medians[name],
                     "vs_gpipe": medians[name] / medians.get("gpipe", medians[name]),
                     "ideal_s": ideal, "vs_ideal": medians[name] / ideal, "idle": idle})
    if args.json:
        print(json.dumps({"one_device_s": one, "schedules": rows}, indent=1))
        return 0
    print(f"pinned: 2 processes x 1 device, pipe=2; {args.model} d_model {args.d_model or '-'}, "
          f"seq {args.seq_len}, batch {args.batch_size}, {args.microbatches} microbatches, "
          f"{args.steps} steps each; one device, whole batch: {one:.3f} s")
    print(f"{'schedule':<12}{'step (s)':>10}{'vs gpipe':>10}{'ideal (s)':>11}{'vs ideal':>10}"
          f"{'idle':>7}")
    for r in rows:
        print(f"{r['schedule']:<12}{r['median_step_s']:>10.3f}{r['vs_gpipe']:>10.3f}"
              f"{r['ideal_s']:>11.3f}{r['vs_ideal']:>10.3f}{r['idle']:>7.3f}")
    print("(the pipeline rebuilds each chunk's forward in its backward: 4 forward-equivalents "
          "per layer to one device's 3, part of what 'vs ideal' shows)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny",
                        help="model preset in models/ (default: %(default)s)")
    parser.add_argument("--mesh", default="pipe=2,fsdp=4", help="with a pipe axis, on one host")
    parser.add_argument("--zero-stage", type=int, default=3,
                        help="0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters "
                             "(default: %(default)s)")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="microbatches per step (the non-pipelined step accumulates as many) "
                             "(default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128,
                        help="tokens per row (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch, in rows (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, from {', '.join(SCHEDULES)}")
    parser.add_argument("--d-model", type=int, default=0, help="widen the model (0: the preset's)")
    parser.add_argument("--n-layer", type=int, default=0, help="layers (0: the preset's)")
    parser.add_argument("--pinned", action="store_true",
                        help="pipe=2 as 2 processes of 1 device, each pinned to its own core")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    cpu.add_devices_flag(parser)
    args = parser.parse_args(argv)
    if args.pinned:
        return pinned(args, sys.argv[1:] if argv is None else list(argv))
    try:
        cpu.simulate(args.devices)
        config = mesh_lib.load(args.mesh)
    except (ValueError, FileNotFoundError) as e:  # MeshError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (config.dcn != (1,) * len(mesh_lib.AXES) or -1 in config.ici
            or config.ici[mesh_lib.AXES.index("pipe")] < 2):
        parser.error(f"--mesh {args.mesh}: give a one-host mesh with a pipe axis and every size "
                     "fixed, like pipe=2,fsdp=4")

    schedules = args.schedules.split(",")
    if unknown := set(schedules) - set(SCHEDULES):
        parser.error(f"--schedules {args.schedules}: unknown {sorted(unknown)}; choose from "
                     f"{', '.join(SCHEDULES)}")

    corpus = corpus_lib.load("stdlib")
    variants = {"no pipeline": (_without_pipe(args.mesh), "1f1b")}
    variants.update({name: (args.mesh, name) for name in schedules})
    # Every variant checked before any compiles, the given mesh first, so
    # that an error names it rather than its pipe-free twin.
    try:
        jobs = {name: prepare(args, corpus, *variants[name])
                for name in sorted(variants, key=lambda name: name == "no pipeline")}
    except ValueError as e:  # a mesh the devices do not cover, a batch that does not split
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = {name: _run(jobs[name], corpus, args, mesh) for name, (mesh, _) in variants.items()}

    medians = interleaved_medians(runs, args.steps)
    base = medians["no pipeline"]
    rows = [{"variant": name, "mesh": r["mesh"], "median_step_s": medians[name],
             "ratio": medians[name] / base} for name, r in runs.items()]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{args.model}, seq {args.seq_len}, batch {args.batch_size}, "
              f"{args.microbatches} microbatches, ZeRO-{args.zero_stage}, {args.steps} steps each")
        print(f"{'variant':<14}{'mesh':<24}{'step (s)':>10}{'ratio':>8}")
        for row in rows:
            print(f"{row['variant']:<14}{row['mesh']:<24}{row['median_step_s']:>10.3f}"
                  f"{row['ratio']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
