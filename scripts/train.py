"""Train a model with ZeRO sharding on a device mesh.

    python scripts/train.py                       # the main job: gpt-tiny, ZeRO-3, cpu-8
    python scripts/train.py --mesh data=2,fsdp=4 --zero-stage 1 --steps 100
    python scripts/train.py --checkpoint-dir ckpt --checkpoint-every 100 [--resume]
    python scripts/train.py --config run.toml --metrics-out metrics.jsonl

Prints the resolved plan, then trains with a progress bar and periodic
validation. Every flag is also a key of the TOML run config (see --help).
Exit status: 0 done (or preempted and saved), 2 bad input, 3 training halted
(non-finite gradients), 4 a checkpoint could not be saved or restored, 5 a
step ran far past the recent median (the watchdog), 6 processes disagree
on the config or the compiled step.

Under scripts/launch.py, SLURM, Open MPI or on a TPU pod each process runs
this same script; `jax.distributed` is set up from the environment.
"""

from __future__ import annotations

import argparse
import signal
import sys

import jax

import models
from zero_jax import flags
from zero_jax.checkpoint import manager as ckpt_lib
from zero_jax import config as config_lib, job as job_lib, loop, run
from zero_jax.runtime import cpu
from zero_jax.data import corpus as data_lib
from zero_jax.runtime import distributed
from zero_jax.analysis import flops
from zero_jax.analysis import hlo
from zero_jax.analysis import summary as plan
from zero_jax.sharding.mesh import MeshError
from zero_jax.sharding.rules import ShardingError


def parse(argv: list[str] | None = None) -> tuple[config_lib.RunConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML run config; flags override it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cpu.add_devices_flag(parser)
    flags.add_flags(parser)
    args = parser.parse_args(argv)
    return flags.from_args(args, args.config), args


def start_up_fingerprint(cfg: config_lib.RunConfig, lowered) -> dict[str, str]:
    """A hash of the program each process compiles (the lowered train step:
    compiled text differs when one process finds it in the compilation
    cache), and every config field but this process's own."""
    flat = {f"{section}.{key}": value for section, fields in cfg.to_dict().items()
            for key, value in fields.items() if section != "distributed"}
    return {"train_step": distributed.fingerprint(lowered.as_text()), **flat}


def main(argv: list[str] | None = None) -> int:
    # A size limit on files (disk quota) must fail the write, not kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        cfg, args = parse(argv)
        # Both before anything asks JAX for devices.
        cpu.simulate(args.devices)
        distributed.initialize(cfg.distributed)
        corpus = data_lib.load(cfg.data.source)
        build, model_line = models.for_run(cfg.model, corpus.vocab_size)
        job = job_lib.prepare(cfg, build)
        # Bad data stops here, before anything compiles.
        data_lib.check(corpus, job.model.config.vocab_size, cfg.data.seq_len,
                       models.weight_dirs(cfg.model.name, cfg.checkpoint.init_from))
    except (config_lib.ConfigError, MeshError, ShardingError, ValueError, FileNotFoundError,
            distributed.DistributedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    lowered = job.lower_train_step()
    # The process that prints the plan compiles with the HLO after
    # partitioning written out, for its collective bytes (this compile skips
    # the persistent cache); the others compile as usual.
    lead = jax.process_index() == 0
    train_step, partitioned = hlo.compile_partitioned(lowered) if lead else (lowered.compile(), None)
    try:
        # Processes about to run different programs would hang in the first
        # collective: compare before running anything.
        distributed.agree("start-up", start_up_fingerprint(cfg, lowered),
                          cfg.distributed.barrier_timeout_s)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 6
    eval_step = job.compile_eval_step()
    data_line = (f"{corpus.name}: {corpus.tokens('train'):,} train / {corpus.tokens('val'):,} "
                 f"validation tokens, vocab {corpus.vocab_size}"
                 + (", loss on masked targets only" if corpus.masked else ""))
    throughput = flops.throughput(job)  # on CPU, the first run measures the peak (seconds)
    if lead:
        print(plan.describe(job, data_line, model_line, train_step, partitioned), flush=True)
        print(flops.describe(throughput), flush=True)

    try:
        outcome = run.train(job, corpus, train_step, eval_step, loaders=[models.hf_loader],
                            progress=not args.no_progress, throughput=throughput)
    except loop.TrainingHalted as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except ckpt_lib.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except run.InitFromError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history = outcome.history
    if not history:
        print(f"nothing to do: the state is already at step {int(distributed.local(outcome.state.step))}")
        return 0
    last = history[-1]
    # The first step compiles nothing (compiled ahead) but warms caches: left out.
    tokens_per_s = sorted(r["tokens_per_s"] for r in history[1:] or history)
    median = tokens_per_s[len(tokens_per_s) // 2]
    rate = throughput.fields(median)
    val = f", validation loss {last['val_loss']:.4f} nats/token" if "val_loss" in last else ""
    mfu = f", MFU {rate['mfu']:.1%}" if "mfu" in rate else ""
    print(f"{outcome.stopped or 'done'}: step {last['step']}, train loss {last['loss']:.4f}{val}, "
          f"median {median:,.0f} tokens/s on {jax.device_count()} devices"
          + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
          + f" ({rate['model_tflops_per_device'] * 1e3:,.1f} model GFLOP/s per device{mfu})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
