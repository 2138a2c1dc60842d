"""Compiled temporaries of a training step per device against sequence
length: whether attention's T x T scores are materialised, and how much of
them each context-parallel strategy leaves on a device.

    python scripts/check_attention.py                          # here: XLA's attention, one device
    python scripts/check_attention.py --attention cudnn        # on a GPU: cuDNN's fused kernel
    python scripts/check_attention.py --devices 8 --batch-size 8 --seq-lens 4096,8192,16384 \\
        --meshes fsdp=8,context=8 --context-attention all-gather,ring,ulysses

Compiles one step of a Llama-family model at each sequence length on each
mesh (no step is run) and prints `memory_analysis()`'s temporaries per
device, the part of them that the T x T float32 scores of every head of one
layer would be for the rows a device attends for, and each length's
temporaries over the previous one's. Doubling T doubles what grows linearly
and quadruples the scores: XLA's implementation shows the growth, cuDNN's
(bf16 on a GPU) should not. A mesh with a `context` axis is compiled once
per strategy of --context-attention (zero_jax/context); on `fsdp=8` each
device attends for whole rows, on `context=8` for an eighth of each row.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import memory
from zero_jax.runtime import cpu
from zero_jax.sharding import mesh as mesh_lib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny", help="a Llama-family or GPT preset")
    parser.add_argument("--seq-lens", default="1024,2048,4096", help="comma list of lengths")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="rows per step (default: one per device)")
    parser.add_argument("--meshes", default="fsdp=-1",
                        help="comma list of inline meshes, each one axis=size (e.g. fsdp=8,context=8)")
    parser.add_argument("--context-attention", default="ring",
                        help="comma list of strategies for meshes with a context axis: "
                             "all-gather, ring, ulysses")
    parser.add_argument("--attention", default="auto", help="xla | cudnn | auto")
    parser.add_argument("--precision", default="auto", help="fp32 | bf16 | fp16 | auto")
    parser.add_argument("--remat", default="full", help="activation policy (remat.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows")
    cpu.add_devices_flag(parser)
    args = cpu.parse_args(parser, argv)
    lens = [int(t) for t in args.seq_lens.split(",")]
    strategies = args.context_attention.split(",")
    layouts = []
    for mesh in args.meshes.split(","):
        sizes = dict(zip(mesh_lib.AXES, mesh_lib.parse_inline(mesh).ici))
        layouts += [(mesh, s) for s in strategies] if sizes["context"] > 1 else [(mesh, "")]
    rows = []
    for T in lens:
        for mesh, strategy in layouts:
            run = config_lib.build(None, {
                "model.name": args.model, "model.max_seq_len": max(lens), "model.vocab_size": 256,
                "model.attention": args.attention, "parallel.mesh": mesh,
                "parallel.context_attention": strategy or "auto",
                "precision.policy": args.precision, "activations.remat": args.remat,
                "data.seq_len": T, "train.batch_size": args.batch_size or jax.device_count()})
            job = job_lib.prepare(run, models.for_run(run.model, 256)[0])
            compiled = memory.compiled(job.compile_train_step())
            sizes = job.state_plan.mesh_shape.sizes
            local_rows = run.train.batch_size // job.state_plan.data_parallel_size
            queries = T // sizes["context"]
            rows.append({"seq_len": T, "mesh": mesh, "context_attention": strategy or "-",
                         "attention": job.hooks.attention, "temp_bytes": compiled["temp_bytes"],
                         "scores_bytes": job.model.config.n_head * queries * T * 4 * local_rows})
    for row in rows:
        prev = [r for r in rows if (r["mesh"], r["context_attention"]) ==
                (row["mesh"], row["context_attention"]) and r["seq_len"] < row["seq_len"]]
        row["growth"] = row["temp_bytes"] / prev[-1]["temp_bytes"] if prev else None
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.model}, {jax.devices()[0].platform}, remat {args.remat}, "
          f"batch {args.batch_size or jax.device_count()}, per device")
    print(f"{'T':>6}  {'mesh':<12}{'context':<11}{'attention':<10}{'temp MiB':>10}"
          f"{'scores MiB':>12}{'x previous':>12}")
    for r in rows:
        growth = f"{r['growth']:.2f}" if r["growth"] else "-"
        print(f"{r['seq_len']:>6}  {r['mesh']:<12}{r['context_attention']:<11}{r['attention']:<10}"
              f"{r['temp_bytes'] / 2**20:>10.1f}{r['scores_bytes'] / 2**20:>12.1f}{growth:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
