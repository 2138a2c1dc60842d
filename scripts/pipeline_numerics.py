"""Loss and gradient errors of every pipeline configuration against one device.

    python scripts/pipeline_numerics.py            # 3 schedules x 3 meshes x m {4, 8} x ZeRO {1, 3}
    python scripts/pipeline_numerics.py --schedule 1f1b --mesh pipe=2,fsdp=4 --microbatches 4
    python scripts/pipeline_numerics.py --steps 10 --mesh pipe=2,fsdp=2,tensor=2 --layout auto \
        --schedule gpipe --schedule 1f1b --schedule zb-h1 --microbatches 4 --zero-stage 3

One step of gpt-tiny with 8 layers (seq 16, batch 32, fp32): for each
configuration, the relative error of the loss and the worst relative error
(||a - b|| / ||b||) over the gradient tensors, against the non-pipelined
step on a single device. The tests assert the same grid within 1e-5
(`ZERO_JAX_FULL_GRID=1 pytest tests/test_pipeline.py`); this prints the
measured numbers. `--schedule`, `--mesh`, `--microbatches` and
`--zero-stage` (each repeatable) narrow the grid; `--layout` replaces each
mesh's layout (`fsdp_tp_sp` under `tensor`, else the default). With
`--steps N` each configuration trains N AdamW steps instead, and the losses
of every step are printed with their worst relative error against the
single device's. On 8 simulated CPU devices unless --devices or XLA_FLAGS
say otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import typing

import jax
import numpy as np

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.runtime import cpu
from zero_jax.data import corpus as corpus_lib

MESHES = {"pipe=2,fsdp=4": {}, "pipe=2,fsdp=2,tensor=2": {"parallel.layout": "fsdp_tp_sp"},
          "pipe=4,data=2": {}}
SCHEDULES = ("gpipe", "1f1b", "interleaved")  # the default grid; zb-h1 on request
MICROBATCHES = (4, 8)
ZERO_STAGES = (1, 3)


def _job(corpus, devices=None, **flat):
    run = config_lib.build(None, {"data.seq_len": 16, "train.batch_size": 32, **flat})
    return job_lib.prepare(run, models.builder("gpt-tiny", corpus.vocab_size, n_layer=8), devices)


def _batch(corpus, job, step):
    return corpus_lib.global_batch(corpus, "train", 16, 32, 0, step=step,
                                 sharding=job.state_plan.batch_sharding)


def loss_and_grads(corpus, devices=None, **flat):
    job = _job(corpus, devices, **flat)
    loss, grads = job.jit_loss_and_grads()(job.init_state().params, _batch(corpus, job, 0))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


def losses(corpus, steps: int, devices=None, **flat) -> np.ndarray:
    """The loss of each of `steps` training steps, each waited on."""
    job = _job(corpus, devices, **flat)
    step, state, out = job.compile_train_step(), job.init_state(), []
    for i in range(steps):
        state, metrics = step(state, _batch(corpus, job, i))
        out.append(float(metrics["loss"]))
    return np.array(out)


def _grid(args):
    for schedule, mesh, m, zero in itertools.product(
            args.schedule or SCHEDULES, args.mesh or MESHES, args.microbatches or MICROBATCHES,
            args.zero_stage or ZERO_STAGES):
        layout = {"parallel.layout": args.layout} if args.layout else MESHES[mesh]
        yield (schedule, mesh, m, zero), {
            "parallel.mesh": mesh, "parallel.pipeline_schedule": schedule,
            "train.microbatches": m, "parallel.zero_stage": zero, **layout}


def _trained(corpus, args) -> int:
    reference = losses(corpus, args.steps, jax.devices()[:1], **{"parallel.mesh": "fsdp=1"})
    print(f"one device: {' '.join(f'{x:.6f}' for x in reference)}")
    worst = 0.0
    for (schedule, mesh, m, zero), flat in _grid(args):
        got = losses(corpus, args.steps, **flat)
        err = float(np.max(np.abs(got - reference) / np.abs(reference)))
        worst = max(worst, err)
        print(f"{schedule} {mesh} m={m} ZeRO-{zero}: {' '.join(f'{x:.6f}' for x in got)}"
              f"  (worst relative error {err:.1e})", flush=True)
    print(f"worst over {args.steps} steps: {worst:.1e}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", action="append", choices=(*SCHEDULES, "zb-h1"),
                        help=f"default: {', '.join(SCHEDULES)}")
    parser.add_argument("--mesh", action="append", choices=tuple(MESHES),
                        help=f"default: {', '.join(MESHES)}")
    parser.add_argument("--microbatches", action="append", type=int,
                        help=f"default: {', '.join(map(str, MICROBATCHES))}")
    parser.add_argument("--zero-stage", action="append", type=int,
                        help=f"default: {', '.join(map(str, ZERO_STAGES))}")
    parser.add_argument("--layout", choices=typing.get_args(config_lib.LayoutName),
                        help="every mesh's layout (default: fsdp_tp_sp under tensor, else auto)")
    parser.add_argument("--steps", type=int, default=0,
                        help="train this many steps and compare every step's loss (default: "
                             "one step's loss and gradients)")
    cpu.add_devices_flag(parser, default_help="XLA_FLAGS's, else 8")
    args = cpu.parse_args(parser, argv, default=8)
    corpus = corpus_lib.load("stdlib")
    if args.steps:
        return _trained(corpus, args)
    ref_loss, ref_grads = loss_and_grads(corpus, jax.devices()[:1], **{"parallel.mesh": "fsdp=1"})
    worst = [0.0, 0.0]
    print(f"{'schedule':<12}{'mesh':<24}{'m':>3}{'zero':>5}{'loss err':>11}{'grad err':>11}")
    for (schedule, mesh, m, zero), flat in _grid(args):
        loss, grads = loss_and_grads(corpus, **flat)
        loss_err = abs(loss - ref_loss) / abs(ref_loss)
        grad_err = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
                       for a, b in zip(grads, ref_grads))
        worst = [max(worst[0], loss_err), max(worst[1], grad_err)]
        print(f"{schedule:<12}{mesh:<24}{m:>3}{zero:>5}{loss_err:>11.1e}{grad_err:>11.1e}",
              flush=True)
    print(f"worst: loss {worst[0]:.1e}, gradient tensor {worst[1]:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
