"""Mixed precision: policies, loss scaling, skipped steps, bytes per parameter."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import host, make_job
from zero_jax import config as config_lib, job as job_lib, loop
from zero_jax.runtime.metrics import MetricsWriter, Writers
from zero_jax.data import corpus as corpus_lib
from zero_jax.analysis import memory
from zero_jax.precision import loss_scale as loss_scale_lib

CFG = loss_scale_lib.LossScaleConfig(enabled=True, initial_scale_power=10, window=3, hysteresis=2,
                         min_scale=4.0)
FINITE, OVERFLOW = jnp.array(True), jnp.array(False)


def test_loss_scale_follows_deepspeed_rules():
    s = loss_scale_lib.init(CFG)
    assert float(s.scale) == 1024.0
    s = loss_scale_lib.update(CFG, s, OVERFLOW)  # hysteresis 2: the first overflow is tolerated
    assert float(s.scale) == 1024.0 and int(s.skipped) == 1 and int(s.consecutive) == 1
    s = loss_scale_lib.update(CFG, s, OVERFLOW)  # the second halves
    assert float(s.scale) == 512.0 and int(s.consecutive) == 2
    s = loss_scale_lib.update(CFG, s, OVERFLOW)  # and every further one while hysteresis is spent
    assert float(s.scale) == 256.0
    for _ in range(2):
        s = loss_scale_lib.update(CFG, s, FINITE)
    assert float(s.scale) == 256.0 and int(s.consecutive) == 0
    s = loss_scale_lib.update(CFG, s, FINITE)  # window = 3 finite steps: double, hysteresis restored
    assert float(s.scale) == 512.0 and int(s.hysteresis) == 2 and int(s.skipped) == 3
    for _ in range(10):
        s = loss_scale_lib.update(CFG, s, OVERFLOW)
    assert float(s.scale) == 4.0  # never below min_scale


def test_without_scaling_only_skips_are_counted():
    cfg = loss_scale_lib.LossScaleConfig(enabled=False)
    s = loss_scale_lib.update(cfg, loss_scale_lib.init(cfg), OVERFLOW)
    assert float(s.scale) == 1.0 and int(s.skipped) == 1


def _fp16_job(corpus, **kw):
    return make_job(corpus, precision="fp16", hysteresis=1, mesh="fsdp=4,tensor=2",
                    layout="fsdp_tp", **kw)


def _batches(job, corpus):
    t = job.run.train
    return functools.partial(corpus_lib.global_batch, corpus, "train", job.run.data.seq_len,
                             t.batch_size, t.seed, sharding=job.state_plan.batch_sharding)


def test_fp16_overflow_is_skipped_bitwise_then_training_recovers(corpus):
    # 2^24 makes fp16 gradients overflow; each skipped step halves the scale.
    job = _fp16_job(corpus, initial_scale_power=24, steps=40)
    step, batch = job.compile_train_step(), _batches(job, corpus)
    state = job.init_state()
    before = host((state.params, state.opt_state))
    state, m = step(state, batch(step=0))
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 2.0 ** 24
    after = host((state.params, state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # bitwise unchanged
    assert int(state.loss_scale.skipped) == 1 and float(state.loss_scale.scale) == 2.0 ** 23
    assert int(state.step) == 1  # the batch was consumed
    for i in range(1, 40):
        state, m = step(state, batch(step=i))
        if not bool(m["skipped"]):
            break
    else:
        pytest.fail("the loss scale never came down to a finite step")
    assert np.isfinite(float(m["loss"])) and float(m["loss_scale"]) < 2.0 ** 24
    changed = host(state.params)
    assert any((a != b).any() for a, b in zip(jax.tree.leaves(changed), jax.tree.leaves(before[0])))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(changed))


def test_consecutive_skip_limit_stops_training(corpus, tmp_path):
    job = _fp16_job(corpus, initial_scale_power=60, steps=20)
    with pytest.raises(loop.TrainingHalted, match="3 steps in a row had non-finite gradients"):
        loop.train(job.init_state(), job.compile_train_step(), lambda s: _batches(job, corpus)(step=s),
                   steps=20, max_consecutive_skips=3, observers=loop.Observers(
                       writers=Writers(MetricsWriter(str(tmp_path / "m.jsonl"))), progress=False))
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all('"skipped": true' in line for line in lines)


def test_fp16_trains(corpus):
    job = _fp16_job(corpus, steps=10)
    step, batch = job.compile_train_step(), _batches(job, corpus)
    state, losses = job.init_state(), []
    for i in range(10):
        state, m = step(state, batch(step=i))
        losses.append(float(m["loss"]))
    assert int(state.loss_scale.skipped) == 0 and losses[-1] < losses[0] - 0.5


def _gpt_medium(stage, **overrides):
    # Arrays that tensor does not split (positions, LayerNorms, some biases) are
    # split 4 ways, not 8: 1.1% of gpt-small's bytes, 0.5% of gpt-medium's.
    run = config_lib.build(None, {"model.name": "gpt-medium", "parallel.mesh": "fsdp=4,tensor=2",
                                  "parallel.zero_stage": stage, "model.vocab_multiple": 128,
                                  "precision.policy": "bf16", "data.seq_len": 128,
                                  "train.batch_size": 8, **overrides})
    return job_lib.prepare(run, models.builder("gpt-medium", 50257))


@pytest.mark.parametrize("grad_dtype,per_param", [("", 16), ("bfloat16", 14)])
def test_gpt_medium_bf16_zero3_bytes_per_parameter(grad_dtype, per_param):
    """fsdp=4 x tensor=2, ZeRO-3, bf16 compute, fp32 Adam: 4 + grad bytes + 8 per parameter / 8."""
    job = _gpt_medium(3, **{"precision.grad_dtype": grad_dtype})
    psi = memory.param_count(job.state_plan)
    sharded = memory.sharded(job.state_plan)
    theory = memory.theory(job.state_plan)
    assert sum(memory.bytes_per_param(job.state_plan).values()) == per_param
    assert sum(sharded.values()) == pytest.approx(per_param * psi / 8, rel=0.01)
    assert sum(theory.values()) == pytest.approx(per_param * psi / 8, rel=0.01)
    compiled = memory.compiled(job.compile_train_step())
    scalars = sum(x.size * x.dtype.itemsize for x in
                  jax.tree.leaves((job.state_plan.abstract.step, job.state_plan.abstract.loss_scale)))
    batch = sum(math.prod(job.state_plan.batch_sharding.shard_shape(b.shape)) * b.dtype.itemsize
                for b in job.abstract_batch.values())  # tokens and loss mask
    assert compiled["argument_bytes"] == sharded["params"] + sharded["opt_state"] + scalars + batch


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_formulas_hold_with_tensor_parallelism(stage):
    job = _gpt_medium(stage)
    sharded, theory = memory.sharded(job.state_plan), memory.theory(job.state_plan)
    for k in ("params", "grads", "opt_state"):
        assert sharded[k] == pytest.approx(theory[k], rel=0.01), k


# bfloat16 parameters with the default (float32) moments: optax makes its
# moments in the parameters' dtype, and the step must still get float32 ones.
@pytest.mark.parametrize("opt_state_dtype,state_bytes", [("bfloat16", 4), ("", 8)])
def test_optimizer_state_dtype_and_pure_bf16_parameters(corpus, opt_state_dtype, state_bytes):
    job = make_job(corpus, opt_state_dtype=opt_state_dtype, param_dtype="bfloat16", steps=3)
    dtypes = {x.dtype for x in jax.tree.leaves(job.state_plan.abstract.opt_state) if x.ndim}
    assert dtypes == {jnp.dtype(opt_state_dtype or jnp.float32)}
    assert {p.dtype for p in jax.tree.leaves(job.state_plan.abstract.params)} == {jnp.dtype(jnp.bfloat16)}
    assert memory.bytes_per_param(job.state_plan) == {"params": 2, "grads": 4, "opt_state": state_bytes}
    from tests.helpers import train
    losses, state = train(job, corpus)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
