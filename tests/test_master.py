"""Float32 master weights in the sharded optimizer state (ZeRO-1 and 2 under
bf16): bytes as the ZeRO paper counts them, the model's arithmetic unchanged,
skipped steps, any optax transformation, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import host, initial_state, make_job, train
from zero_jax import config as config_lib, job as job_lib
from zero_jax.precision import master
from zero_jax.analysis import memory

BF16 = dict(precision="bf16")


def _gpt_small(stage, **overrides):
    run = config_lib.build(None, {"model.name": "gpt-small", "parallel.mesh": "fsdp=8",
                                  "parallel.zero_stage": stage, "precision.policy": "bf16",
                                  "data.seq_len": 128, "train.batch_size": 8,
                                  "parallel.min_shard_elements": 0, **overrides})
    return job_lib.prepare(run, models.builder("gpt-small", 50257))


@pytest.mark.parametrize("grad_dtype,g", [("bfloat16", 2), ("", 4)])
def test_bytes_per_parameter_are_at_most_the_zero_papers(grad_dtype, g):
    """Mixed-precision Adam, N = 8: (2 + 2 + 12), (2 + 2) + 12/N, 2 + (2 + 12)/N
    and (2 + 2 + 12)/N with bf16 gradients; 4 for g with float32 ones. Stages
    0 and 3 keep the float32 parameters as the master: 4 + g + 8 (per N)."""
    n = 8
    limits = {0: 4 + g + 8, 1: 2 + g + 12 / n, 2: 2 + (g + 12) / n, 3: (4 + g + 8) / n}
    for stage, limit in limits.items():
        job = _gpt_small(stage, **{"precision.grad_dtype": grad_dtype})
        psi = memory.param_count(job.state_plan)
        per = sum(memory.sharded(job.state_plan).values()) / psi
        print(f"stage {stage}, gradients {g} B: {per:.4f} bytes per parameter (limit {limit:.4f})")
        assert per <= limit * 1.005, stage
        assert per == pytest.approx(sum(memory.theory(job.state_plan).values()) / psi, rel=1e-3)
        assert job.state_plan.master == (stage in (1, 2))


def test_the_working_copy_keeps_each_parameter_in_the_dtype_the_model_uses(corpus):
    job = make_job(corpus, zero_stage=1, **BF16)
    dtypes = jax.tree.map(lambda p: p.dtype, job.state_plan.abstract.params)
    assert dtypes["wte"] == jnp.bfloat16 and dtypes["blocks"]["w_fc"] == jnp.bfloat16
    assert dtypes["blocks"]["ln_1"]["scale"] == jnp.float32  # LayerNorm runs in float32
    assert dtypes["blocks"]["b_fc"] == jnp.float32  # biases are added in float32
    opt = job.state_plan.abstract.opt_state
    assert isinstance(opt, master.MasterState)
    assert {x.dtype for x in jax.tree.leaves(opt.master)} == {jnp.dtype(jnp.float32)}
    # The master weights are sharded like the moments.
    assert job.state_plan.specs.opt_state.master["blocks"]["w_fc"] == \
        job.state_plan.specs.sharded["blocks"]["w_fc"]
    assert job.state_plan.specs.params["blocks"]["w_fc"] == job.state_plan.specs.compute["blocks"]["w_fc"]


def test_master_weights_change_no_arithmetic(corpus, optimizer="adamw", microbatches=2):
    """ZeRO-1 with master weights takes, bitwise, the steps of the float32
    parameters replicated (stage 0) on the same mesh: both all-reduce the
    gradients, and the update is elementwise."""
    kw = dict(mesh="fsdp=8", optimizer=optimizer, microbatches=microbatches, batch_size=32,
              steps=6, **BF16)
    ref_losses, ref = train(make_job(corpus, zero_stage=0, **kw), corpus)
    job = make_job(corpus, zero_stage=1, **kw)
    losses, state = train(job, corpus)
    np.testing.assert_array_equal(losses, ref_losses)
    jax.tree.map(np.testing.assert_array_equal, host(state.opt_state.master), host(ref.params))
    working = master.cast_to(job.state_plan.working_dtypes)(host(ref.params))
    jax.tree.map(np.testing.assert_array_equal, host(state.params), working)


def test_a_skipped_step_leaves_master_moments_and_working_copy_bitwise(corpus):
    job = make_job(corpus, zero_stage=1, precision="fp16", initial_scale_power=24, hysteresis=1,
                   steps=3)
    assert job.state_plan.master
    state = initial_state(job)
    before = host(state)
    t = job.run.train
    from zero_jax.data import corpus as corpus_lib
    batch = corpus_lib.global_batch(corpus, "train", job.run.data.seq_len, t.batch_size, t.seed,
                                  step=0, sharding=job.state_plan.batch_sharding)
    state, m = job.compile_train_step()(state, batch)
    assert bool(m["skipped"])
    after = host(state)
    for a, b in ((after.params, before.params), (after.opt_state, before.opt_state)):
        jax.tree.map(np.testing.assert_array_equal, a, b)
