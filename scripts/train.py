"""Train a model with ZeRO sharding on a device mesh.

    python scripts/train.py                       # the main job: gpt-tiny, ZeRO-3, cpu-8
    python scripts/train.py --mesh data=2,fsdp=4 --zero-stage 1 --steps 100
    python scripts/train.py --config run.toml --metrics-out metrics.jsonl

Prints the resolved plan, then trains with a progress bar and periodic
validation. Every flag is also a key of the TOML run config (see --help).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax

import models
from zero_jax import config as config_lib, data as data_lib, job as job_lib, loop, plan
from zero_jax.mesh import MeshError
from zero_jax.rules import ShardingError


def parse(argv: list[str] | None = None) -> tuple[config_lib.RunConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML run config; flags override it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    config_lib.add_flags(parser)
    args = parser.parse_args(argv)
    return config_lib.from_args(args, args.config), args


def main(argv: list[str] | None = None) -> int:
    try:
        run, args = parse(argv)
        corpus = data_lib.load(run.data.source)
        model = models.builder(run.model.name, corpus.vocab_size)
        job = job_lib.prepare(run, model)
    except (config_lib.ConfigError, MeshError, ShardingError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    train_step = job.compile_train_step()
    eval_step = job.compile_eval_step()
    data_line = (f"{corpus.name}: {len(corpus.train):,} train / {len(corpus.val):,} "
                 f"validation tokens, vocab {corpus.vocab_size}")
    model_line = models.describe(run.model.name, corpus.vocab_size, run.model.vocab_multiple)
    print(plan.describe(job, data_line, model_line, train_step), flush=True)

    t, seq = run.train, run.data.seq_len
    sharding = job.layout.batch_sharding
    batch = functools.partial(data_lib.global_batch, corpus, "train", seq, t.batch_size,
                              t.seed, sharding=sharding)
    val_batch = functools.partial(data_lib.global_batch, corpus, "val", seq, t.batch_size,
                                  t.seed, sharding=sharding)
    eval_fn = functools.partial(loop.evaluate, eval_step, batches=val_batch, n=t.eval_batches)

    state = job.init_state()
    try:
        state, history = loop.train(
            state, train_step, lambda step: batch(step=step), steps=t.steps,
            eval_fn=lambda params: eval_fn(params), eval_every=t.eval_every,
            metrics_path=t.metrics_out, progress=not args.no_progress,
            max_consecutive_skips=run.precision.max_consecutive_skips)
    except loop.TrainingHalted as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    last = history[-1]
    tokens_per_s = sorted(r["tokens_per_s"] for r in history[1:] or history)
    print(f"done: {len(history)} steps, final train loss {last['loss']:.4f}, validation loss "
          f"{last['val_loss']:.4f} nats/token, median {tokens_per_s[len(tokens_per_s) // 2]:,.0f} "
          f"tokens/s on {jax.device_count()} devices")
    return 0


if __name__ == "__main__":
    sys.exit(main())
