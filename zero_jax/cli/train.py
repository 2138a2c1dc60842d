"""Train a model with ZeRO sharding on a device mesh.

    zero-jax train                       # the main job: gpt-tiny, ZeRO-3, cpu-8
    zero-jax train --mesh data=2,fsdp=4 --zero-stage 1 --steps 100
    zero-jax train --checkpoint-dir ckpt --checkpoint-every 100 [--resume]
    zero-jax train --config run.toml --metrics-out metrics.jsonl

Prints the resolved plan, then trains with a progress bar and periodic
validation. Every flag is also a key of the TOML run config (see --help).
Exit status: 0 done (or preempted and saved), 2 bad input, 3 training halted
(non-finite gradients), 4 a checkpoint could not be saved or restored, 5 a
step ran far past the recent median (the watchdog), 6 processes disagree on
the config or the compiled step, 130 interrupted (Ctrl-C: the step in flight
ends and is saved, one line says which step is restorable; a second Ctrl-C
exits at once).

Under `zero-jax launch`, SLURM, Open MPI or on a TPU pod each process runs
this same command; `jax.distributed` is set up from the environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import jax

import models
from zero_jax.config import flags
from zero_jax import config as config_lib, job as job_lib, loop, run
from zero_jax.analysis import flops, hlo
from zero_jax.analysis import memory
from zero_jax.report import summary
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.checkpoint import weights
from zero_jax.data import corpus as corpus_lib
from zero_jax.runtime import cpu, distributed, preempt
from zero_jax.sharding.mesh import MeshError
from zero_jax.sharding.rules import ShardingError

# What a bad input raises before anything compiles: exit status 2.
INPUT_ERRORS = (config_lib.ConfigError, MeshError, ShardingError, ValueError, FileNotFoundError,
                distributed.DistributedError)
# What ends a run that started -> its exit status (the module docstring).
RUN_ERRORS = {loop.TrainingHalted: 3, manager_lib.CheckpointError: 4, run.InitFromError: 2}


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


def prepare(argv: list[str] | None):
    """(config, flags, corpus, job, model line): every input checked (INPUT_ERRORS)."""
    cfg, args = parse(argv)
    # Both before anything asks JAX for devices.
    cpu.simulate(args.devices)
    distributed.initialize(cfg.distributed)
    corpus = corpus_lib.load(cfg.data.source)
    build, model_line = models.for_run(cfg.model, corpus.vocab_size)
    job = job_lib.prepare(cfg, build)
    # Bad data and weights of another shape stop here, before anything compiles.
    models.check_init_from(cfg.checkpoint.init_from, job)
    weights.check_base_source(job)  # a LoRA resume onto another base
    corpus_lib.check(corpus, job.model.config.vocab_size, cfg.data.seq_len,
                   models.weight_dirs(cfg.model.name, cfg.checkpoint.init_from))
    # A model that cannot fit stops here, before a compile that could take
    # minutes and an initialisation that would fill the host.
    memory.check_fits(job.state_plan, f"--model {cfg.model.name}", processes_here(cfg))
    return cfg, args, corpus, job, model_line


def processes_here(cfg: config_lib.RunConfig) -> int:
    """This run's processes on this machine: every one when their coordinator
    is a loopback address (zero-jax launch starts them all here), else one
    (one process per host, as on a cluster)."""
    coordinator = cfg.distributed.coordinator or os.environ.get(distributed.ENV_COORDINATOR, "")
    host = coordinator.rpartition(":")[0].strip("[]")
    return jax.process_count() if host in ("127.0.0.1", "localhost", "::1") else 1


def compile_train_step(job: job_lib.Job):
    """(lowered, compiled, partitioned HLO or None). The process that prints
    the plan compiles with the HLO after partitioning written out, for its
    collective bytes (this compile skips the persistent cache); the others
    compile as usual."""
    lowered = job.lower_train_step()
    if jax.process_index() == 0:
        return (lowered, *hlo.compile_partitioned(lowered))
    return lowered, lowered.compile(), None


def data_line(corpus) -> str:
    return (f"{corpus.name}: {corpus.tokens('train'):,} train / {corpus.tokens('val'):,} "
            f"validation tokens, vocab {corpus.vocab_size}"
            + (", loss on masked targets only" if corpus.masked else ""))


def final_line(outcome, throughput) -> str:
    """The run's last step, its losses and its median rate."""
    history = outcome.history
    last = history[-1]
    # The first step compiles nothing (compiled ahead) but warms caches: left out.
    tokens_per_s = sorted(r["tokens_per_s"] for r in history[1:] or history)
    median = tokens_per_s[len(tokens_per_s) // 2]
    rate = throughput.fields(median)
    val = f", validation loss {last['val_loss']:.4f} nats/token" if "val_loss" in last else ""
    mfu = f", MFU {rate['mfu']:.1%}" if "mfu" in rate else ""
    return (f"{outcome.stopped or 'done'}: step {last['step']}, train loss {last['loss']:.4f}{val}, "
            f"median {median:,.0f} tokens/s on {jax.device_count()} devices"
            + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
            + f" ({rate['model_tflops_per_device'] * 1e3:,.1f} model GFLOP/s per device{mfu})")


def error(e: Exception, code: int) -> int:
    print(f"error: {e}", file=sys.stderr)
    return code


def status_of(e: Exception) -> int:
    """The exit status of a run that `e` ended (RUN_ERRORS)."""
    return next(code for kind, code in RUN_ERRORS.items() if isinstance(e, kind))


def interrupted_early(cfg: config_lib.RunConfig) -> bool:
    """Whether Ctrl-C came before training began; if so, its one line is said."""
    if not preempt.interrupted():
        return False
    directory = Path(cfg.checkpoint.dir).absolute() if cfg.checkpoint.dir else None
    print(run.interrupted_line("interrupted before training began", directory), file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> int:
    # A size limit on files (disk quota) must fail the write, not kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Ctrl-C sets a flag, read between the steps of start-up here and after
    # every training step: no KeyboardInterrupt lands in JAX or orbax.
    with preempt.interrupts():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        cfg, args, corpus, job, model_line = prepare(argv)
    except INPUT_ERRORS as e:
        return error(e, 2)
    if interrupted_early(cfg):
        return preempt.EXIT_INTERRUPTED
    if jax.process_index() == 0:
        print(run.start_line(job), flush=True)
    lowered, train_step, partitioned = compile_train_step(job)
    try:
        # Processes about to run different programs would hang in the first
        # collective: compare before running anything.
        distributed.agree("start-up", start_up_fingerprint(cfg, lowered),
                          cfg.distributed.barrier_timeout_s)
    except distributed.DistributedError as e:
        return error(e, 6)
    if interrupted_early(cfg):
        return preempt.EXIT_INTERRUPTED
    eval_step = job.compile_eval_step()
    throughput = flops.throughput(job)  # on CPU, the first run measures the peak (seconds)
    plan = None
    if jax.process_index() == 0:
        report = job.memory_report(train_step, partitioned)
        print(summary.describe(job, data_line(corpus), model_line, report=report), flush=True)
        print(flops.describe(throughput), flush=True)
        plan = summary.tables(job, data_line(corpus), model_line, report)  # for W&B
    if interrupted_early(cfg):
        return preempt.EXIT_INTERRUPTED
    try:
        outcome = run.train(job, corpus, run.CompiledSteps(train_step, eval_step),
                            loaders=[models.hf_loader, models.peft_loader],
                            reporting=run.Reporting(progress=not args.no_progress,
                                                    throughput=throughput, plan=plan))
    except tuple(RUN_ERRORS) as e:
        return error(e, status_of(e))
    if outcome.stopped == "interrupted":
        print(outcome.line, file=sys.stderr)
        return preempt.EXIT_INTERRUPTED
    if not outcome.history:
        print(f"nothing to do: the state is already at step {int(distributed.local(outcome.state.step))}")
        return 0
    print(final_line(outcome, throughput))
    return 0
