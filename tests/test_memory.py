"""Bytes per device: the ZeRO formula, the actual shardings and the compiler agree."""

import math

import jax
import pytest

import models
from tests.helpers import make_job
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import memory

STATES = ("params", "grads", "opt_state")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_bytes_equal_the_formula_where_dimensions_divide(corpus, stage):
    # Every gpt-tiny array has a dimension divisible by 8, and nothing is left whole.
    job = make_job(corpus, zero_stage=stage, min_shard_elements=0)
    assert job.layout.specs.replicated == ()
    assert memory.sharded(job.layout) == pytest.approx(memory.theory(job.layout), rel=0, abs=0)


def _gpt_small(stage, mesh="fsdp=8"):
    run = config_lib.build(None, {"model.name": "gpt-small", "parallel.mesh": mesh,
                                  "parallel.zero_stage": stage, "data.seq_len": 1024,
                                  "train.batch_size": 8})
    return job_lib.prepare(run, models.builder("gpt-small", 50257))


def test_gpt_small_stage_ratios_match_the_zero_paper():
    """fp32 Adam: 4 + 4 + 8 bytes per parameter; stages 1-3 keep 9, 5.5 and 2 of 16."""
    totals = [sum(memory.sharded(_gpt_small(s).layout).values()) for s in range(4)]
    psi = memory.param_count(_gpt_small(0).layout)
    assert 124e6 < psi < 125e6  # GPT-2 small with its 50257-token vocabulary
    assert totals[0] == pytest.approx(16 * psi, rel=1e-6)  # 16 bytes + Adam's step count
    for stage, expected in zip((1, 2, 3), (9 / 16, 5.5 / 16, 2 / 16)):
        assert totals[stage] / totals[0] == pytest.approx(expected, rel=0.01), stage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_arguments_are_the_sharded_state_and_batch(corpus, stage):
    job = make_job(corpus, zero_stage=stage)
    compiled_step = job.compile_train_step()
    compiled = memory.compiled(compiled_step)
    sharded = memory.sharded(job.layout)
    batch = sum(math.prod(job.layout.batch_sharding.shard_shape(b.shape)) * b.dtype.itemsize
                for b in job.abstract_batch.values())  # tokens and loss mask
    scalars = sum(x.size * x.dtype.itemsize for x in
                  jax.tree.leaves((job.layout.abstract.step, job.layout.abstract.loss_scale)))
    state = sharded["params"] + sharded["opt_state"] + scalars  # + step, loss-scale scalars
    assert compiled["argument_bytes"] == state + batch
    # Outputs: the same state, the scalar metrics, and XLA's 8-byte pointer per output.
    metrics = jax.tree.leaves(compiled_step.out_info[1])
    metric_bytes = sum(m.size * m.dtype.itemsize for m in metrics)
    outputs = len(jax.tree.leaves(job.layout.abstract)) + len(metrics)
    assert state + metric_bytes <= compiled["output_bytes"] <= state + metric_bytes + 8 * (outputs + 1)


def test_reducing_each_microbatch_shards_the_accumulator(corpus, stage=3):
    """The accumulator's memory is what --grad-reduce trades for traffic.

    Reducing once per step (the default below ZeRO-3) accumulates every
    device's full partial sum; reducing each microbatch into the sharded
    gradient layout (ZeRO-3's default) keeps the accumulator, and the
    microbatch's reduced gradient, at 1/N: compiled temporaries drop by
    2 (N - 1)/N of the gradient bytes.
    """
    temps = {}
    for reduce in ("step", "microbatch"):
        job = make_job(corpus, zero_stage=stage, microbatches=4, batch_size=32, seq_len=128,
                       min_shard_elements=0, grad_reduce=reduce)
        temps[reduce] = memory.compiled(job.compile_train_step())["temp_bytes"]
    grads = sum(x.size * 4 for x in jax.tree.leaves(job.layout.abstract.params))
    one_copy = 7 / 8 * grads  # (N-1)/N of the gradient bytes, N = 8
    saving = temps["step"] - temps["microbatch"]
    print(f"stage {stage}: gradients {grads} B; temporaries {temps}: saving {saving} B = "
          f"{saving / one_copy:.3f} x (N-1)/N of the gradients")
    assert saving == pytest.approx(2 * one_copy, rel=0.05)
