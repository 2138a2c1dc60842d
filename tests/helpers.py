"""Small runs shared by the tests: build a job from flags, train a few steps."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import numpy as np

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.data import corpus as corpus_lib


def make_job(corpus, *, devices=None, **overrides):
    """A Job from config overrides given as {field: value} (flag names)."""
    fields = {"model": "gpt-tiny", "seq_len": 32, "batch_size": 16, "steps": 10,
              "mesh": "fsdp=8", "zero_stage": 3, **overrides}
    where = {f.name: f"{s}.{f.name}" for s, cls in config_lib.SECTIONS.items()
             for f in dataclasses.fields(cls)}
    where.update(model="model.name", optimizer="optim.name", data="data.source",
                 precision="precision.policy", layout="parallel.layout",
                 offload_optimizer="offload.optimizer",
                 offload_params="offload.params",
                 zero_quantized_weights="zero.quantized_weights",
                 zero_quantized_grads="zero.quantized_grads", zero_block_size="zero.block_size",
                 lora_rank="lora.rank", lora_alpha="lora.alpha", lora_targets="lora.targets",
                 lora_init_from="lora.init_from", lora_dropout="lora.dropout",
                 lora_quantize_base="lora.quantize_base", lora_base_block="lora.base_block")
    flat = {where[key]: value for key, value in fields.items()}
    run = config_lib.build(None, flat)
    return job_lib.prepare(run, models.for_run(run.model, corpus.vocab_size)[0], devices)


# A pipelined step loops over ticks, each running a whole stage: the tests
# lower LLVM's optimisation to save compile time (conftest.py), which would
# double these steps' run time, so they keep the default level.
PIPELINE_OPTIONS = {"xla_backend_optimization_level": 2}


def compile_step(job):
    return job.compile_train_step(**(PIPELINE_OPTIONS if job.schedule else {}))


_INITIAL: dict = {}


def initial_state(job):
    """The job's initial state, placed in its layout.

    Initialisation depends on the model, optimizer, precision and seed, not on
    the layout (test_state.py checks that), so it is computed once per such
    key, in the form checkpoints hold, and each layout receives a copy: a
    transfer instead of a compile.
    """
    key = (repr(job.model.config), job.run.optim, job.run.precision, job.policy, job.scale_cfg,
           job.run.train.seed)  # the precision's FP8 scaling adds amax histories
    if key not in _INITIAL:
        _INITIAL[key] = host(job.state_plan.saved_form(job.init_state()))
    targets = job.state_plan.targets
    return job.state_plan.from_saved(jax.device_put(_INITIAL[key], jax.tree.map(lambda t: t.sharding, targets)))


def first_step(job, corpus):
    """Loss and gradients of the job's first batch from its initial state."""
    t = job.run.train
    batch = corpus_lib.global_batch(corpus, "train", job.run.data.seq_len, t.batch_size, t.seed,
                                  step=0, sharding=job.state_plan.batch_sharding)
    return job.jit_loss_and_grads()(initial_state(job).params, batch)


def train(job, corpus, steps=None):
    """Train `steps` steps (default: the config's), waiting on each; returns losses, state."""
    step_fn = compile_step(job)
    state = initial_state(job)
    t = job.run.train
    batch = functools.partial(corpus_lib.global_batch, corpus, "train", job.run.data.seq_len,
                              t.batch_size, t.seed, sharding=job.state_plan.batch_sharding)
    losses = []
    for i in range(steps or t.steps):
        state, metrics = step_fn(state, batch(step=i))
        losses.append(float(metrics["loss"]))  # waits: one step in flight
    return np.array(losses), state


def host(tree):
    """Every leaf as a numpy array (gathered from its devices)."""
    return jax.tree.map(np.asarray, tree)


def assert_close(actual, expected, rtol=1e-5):
    """Each leaf within `rtol` of the reference, as a tensor: |a - b| / |b| <= rtol.

    Every element is also held to 100 x rtol, relative to max(|x|, the leaf's
    RMS), which catches an error confined to a few elements. Element-level
    agreement is looser because Adam normalises each gradient element: where
    a gradient is a sum that nearly cancels (the query bias), the 1e-7
    reduction-order differences between layouts become ~1e-4 differences in
    single updates, while every tensor agrees to ~1e-6 and the whole
    parameter vector to ~1e-7.
    """
    def check(path, a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        name = jax.tree_util.keystr(path)
        norm = np.linalg.norm(b)
        rel = np.linalg.norm(a - b) / norm if norm else np.linalg.norm(a)
        assert rel <= rtol, f"{name}: relative error {rel:.2e} > {rtol}"
        scale = np.maximum(np.abs(b), np.sqrt(np.mean(b * b)) if b.size else 0.0)
        worst = float((np.abs(a - b) / np.maximum(scale, 1e-30)).max()) if b.size else 0.0
        assert worst <= 100 * rtol, f"{name}: an element differs by {worst:.2e} > {100 * rtol}"
    jax.tree_util.tree_map_with_path(check, host(actual), host(expected))


def recorded_steps(path: Path) -> list[int]:
    """The steps of a metrics file's records so far (a line still being
    written, or a missing file, is none)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]
