"""Step time with and without an asynchronous checkpoint commit in flight.

    python scripts/bench_checkpoint.py --devices 8 --model gpt-small --steps 6

Measures, in one process: the step time with no save, the time `save()`
blocks (copying the arrays off the devices), and the step time while the
commit to disk runs in the background. Reports the ratio of the two step
times. A benchmark, not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time

import jax

import models
from zero_jax.checkpoint import manager as manager_lib
from zero_jax import config as config_lib, job as job_lib, run
from zero_jax.runtime import cpu
import bench_flags
from zero_jax.data import corpus as corpus_lib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_flags.add(parser, model="gpt-small", mesh="fsdp=8", seq_len=128, batch_size=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per phase")
    cpu.add_devices_flag(parser)
    args = cpu.parse_args(parser, argv)

    corpus = corpus_lib.load("stdlib")
    cfg = config_lib.build(None, {"model.name": args.model, "parallel.mesh": args.mesh,
                                  "data.seq_len": args.seq_len, "train.batch_size": args.batch_size})
    job = job_lib.prepare(cfg, models.builder(args.model, corpus.vocab_size))
    step_fn = job.compile_train_step()
    batch = functools.partial(corpus_lib.global_batch, corpus, "train", args.seq_len, args.batch_size, 0,
                              sharding=job.state_plan.batch_sharding)
    state = job.init_state()
    i = 0

    def one():
        nonlocal state, i
        start = time.perf_counter()
        state, metrics = step_fn(state, batch(step=i))
        jax.block_until_ready(metrics)
        i += 1
        return time.perf_counter() - start

    for _ in range(2):
        one()  # warm-up
    quiet = [one() for _ in range(args.steps)]
    with tempfile.TemporaryDirectory() as directory:
        c = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=directory), job.state_plan.names,
                                  writer=True)
        start = time.perf_counter()
        c.save(i, state, run.checkpoint_meta(job, i))
        blocked = time.perf_counter() - start
        during = []
        while c.manager.is_saving_in_progress() or not during:
            during.append(one())
        commit = time.perf_counter() - start
        c.wait()
    result = {
        "model": args.model, "mesh": args.mesh,
        "state_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)),
        "step_s_no_save": statistics.median(quiet),
        "save_blocking_s": blocked,
        "commit_s": commit,
        "steps_during_commit": len(during),
        "step_s_during_commit": statistics.median(during),
    }
    result["ratio_during_vs_no_save"] = result["step_s_during_commit"] / result["step_s_no_save"]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
