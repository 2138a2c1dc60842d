"""Ten-step loss differences of every ZeRO stage and mesh against one device.

    python scripts/numerics.py                                   # bf16, float32 gradients
    python scripts/numerics.py --precision bf16 --grad-dtype bfloat16
    python scripts/numerics.py --precision fp32 --mesh fsdp=8 --mesh pipe=2,fsdp=4

gpt-tiny, batch 32, sequence 32, on 8 simulated devices (unless --devices or
XLA_FLAGS say otherwise): for each stage and mesh, the largest relative
difference of the ten losses from the same policy on one device. The tests
hold these to their tolerances (tests/test_numerics.py); this prints the
measured numbers.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.runtime import cpu
from zero_jax.data import corpus as corpus_lib

MESHES = ("fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2", "pipe=2,fsdp=4")
LAYOUTS = {"fsdp=4,tensor=2": "fsdp_tp"}


def losses(corpus, flat: dict, steps: int, devices=None) -> np.ndarray:
    run = config_lib.build(None, {"data.seq_len": 32, "train.batch_size": 32, **flat})
    job = job_lib.prepare(run, models.for_run(run.model, corpus.vocab_size)[0], devices)
    step = job.compile_train_step()
    state, out = job.init_state(), []
    for i in range(steps):
        batch = corpus_lib.global_batch(corpus, "train", 32, 32, run.train.seed, step=i,
                                      sharding=job.state_plan.batch_sharding)
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))  # waits: one step in flight
    return np.array(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16",
                        help="precision policy: fp32 | bf16 | fp16 (default: %(default)s)")
    parser.add_argument("--grad-dtype", default="", help="e.g. bfloat16 (default: the policy's)")
    parser.add_argument("--mesh", action="append", help=f"default: {', '.join(MESHES)}")
    parser.add_argument("--steps", type=int, default=10,
                        help="steps per run, their losses compared (default: %(default)s)")
    cpu.add_devices_flag(parser, default_help="XLA_FLAGS's, else 8")
    args = cpu.parse_args(parser, argv, default=8)
    corpus = corpus_lib.load("stdlib")
    policy = {"precision.policy": args.precision}
    if args.grad_dtype:
        policy["precision.grad_dtype"] = args.grad_dtype
    ref = losses(corpus, {**policy, "parallel.mesh": "fsdp=1", "parallel.zero_stage": 0},
                 args.steps, jax.devices()[:1])
    print(f"{args.precision}, gradients {args.grad_dtype or 'as the policy'}: largest relative "
          f"difference of {args.steps} losses from one device")
    for mesh in args.mesh or MESHES:
        row = []
        for stage in range(4):
            flat = {**policy, "parallel.mesh": mesh, "parallel.zero_stage": stage}
            if mesh in LAYOUTS:
                flat["parallel.layout"] = LAYOUTS[mesh]
            if "pipe" in mesh:
                flat["train.microbatches"] = 2
            got = losses(corpus, flat, args.steps)
            row.append(float(np.max(np.abs(got - ref) / np.abs(ref))))
        print(f"  {mesh:<18}" + "".join(f"  stage {s}: {e:.2e}" for s, e in enumerate(row)),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
