"""Compiled temporaries of a training step against sequence length: whether
attention's T x T scores are materialised.

    python scripts/check_attention.py                          # here: XLA's attention
    python scripts/check_attention.py --attention cudnn        # on a GPU: cuDNN's fused kernel

Compiles one step of a Llama-family model on one device at each sequence
length (no step is run) and prints `memory_analysis()`'s temporaries, the
part of them that T x T float32 scores of every head of one layer would be,
and each length's temporaries over the previous one's. Doubling T doubles
what grows linearly and quadruples the scores: XLA's implementation shows
the growth, cuDNN's (bf16 on a GPU) should not.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import memory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--seq-lens", default="1024,2048,4096")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lens = [int(t) for t in args.seq_lens.split(",")]
    rows = []
    for T in lens:
        run = config_lib.build(None, {
            "model.name": args.model, "model.max_seq_len": max(lens), "model.vocab_size": 256,
            "model.attention": args.attention, "parallel.mesh": "fsdp=-1",
            "precision.policy": args.precision, "activations.remat": args.remat,
            "data.seq_len": T, "train.batch_size": jax.device_count()})
        job = job_lib.prepare(run, models.for_run(run.model, 256)[0])
        compiled = memory.compiled(job.compile_train_step())
        cfg = job.model.config
        rows.append({"seq_len": T, "attention": job.hooks.attention,
                     "temp_bytes": compiled["temp_bytes"],
                     "scores_bytes": cfg.n_head * T * T * 4 * job.run.train.batch_size
                     // jax.device_count()})
    for prev, row in zip([None] + rows, rows):
        row["growth"] = row["temp_bytes"] / prev["temp_bytes"] if prev else None
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.model}, {jax.devices()[0].platform}, remat {args.remat}, one row per device")
    print(f"{'T':>6}  {'attention':<9}{'temp MiB':>10}{'scores MiB':>12}{'x previous':>12}")
    for r in rows:
        growth = f"{r['growth']:.2f}" if r["growth"] else "-"
        print(f"{r['seq_len']:>6}  {r['attention']:<9}{r['temp_bytes'] / 2**20:>10.1f}"
              f"{r['scores_bytes'] / 2**20:>12.1f}{growth:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
