"""Every ZeRO stage on every kind of mesh trains like one device, under fp32
and bf16.

fp32: ten steps of losses and parameters within rtol 1e-5.

bf16 (float32 gradients and master weights): one step's loss within 1e-5 and
its gradients within 1e-5 per tensor, where the layout's matrix products
have the shapes they have on one device; ten steps' losses within 3e-4. Two
things move bf16 results further, both in how a bf16 matrix product is
rounded, not in what is computed: per-device partial sums come from a `vmap`
over the data-parallel shards, whose batched products XLA:CPU rounds
differently in the odd element (gradients to 1e-3), and tensor parallelism
sums row-parallel products across devices in bf16, as Megatron does (the
loss to 1e-4, gradients to 5e-3), as does a pipeline's vocabulary-parallel
head the gradient of its input (its blocks of the vocabulary over `pipe`:
gradients to 5e-3). Over several steps bf16 cannot
match one device to better than about 1e-4 whatever the layout, and plain
DDP (stage 0 on data=8) measures the same: the float32 sums of a step differ
in order by 1e-7, so the master weights do, and the odd one then rounds to
the neighbouring bf16 value, 2^-8 away. (conftest.py turns off XLA's excess
precision, so that where bf16 is rounded does not depend on the layout.)

CI runs every stage under one precision (stages 0 and 2 in fp32, 1 and 3
in bf16), each on one of the meshes in turn (every mesh once);
ZERO_JAX_FULL_GRID=1 runs them all.
"""

import itertools
import os

import jax
import numpy as np
import pytest

from tests.helpers import assert_close, first_step, host, make_job, train
from zero_jax.train import accumulate, grads as grads_lib
from zero_jax.data import corpus as corpus_lib

MESHES = {
    "fsdp=8": {},
    "data=2,fsdp=4": {},
    "fsdp=4,tensor=2": dict(layout="fsdp_tp"),
    "pipe=2,fsdp=4": dict(microbatches=2),
}
BATCH = 32  # two rows per device and microbatch at least: no matrix-vector products
PRECISIONS = ("fp32", "bf16")
GRID = list(itertools.product(PRECISIONS, range(4), MESHES))
FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
names = list(MESHES)
SAMPLED = GRID if FULL else [(p, s, names[(s + 2 * i) % len(names)])
                             for i, p in enumerate(PRECISIONS) for s in range(4)
                             if (p, s) in (("fp32", 0), ("bf16", 1), ("fp32", 2), ("bf16", 3))]
RTOL = 1e-5
BF16_PER_SHARD = 1e-3
BF16_TENSOR_PARALLEL = 5e-3
BF16_TENSOR_PARALLEL_LOSS = 1e-4
BF16_TEN_STEPS = 3e-4


def _job(corpus, precision, stage, mesh, **extra):
    return make_job(corpus, mesh=mesh, zero_stage=stage, precision=precision, batch_size=BATCH,
                    **{**MESHES.get(mesh, {}), **extra})


@pytest.fixture(scope="module")
def reference(corpus):
    """Per precision, the 1-device run: losses, parameters, and step 0's gradients."""
    out = {}
    for precision in PRECISIONS:
        job = _job(corpus, precision, 0, "fsdp=1", devices=jax.devices()[:1])
        grads = host(first_step(job, corpus))
        losses, state = train(job, corpus)
        out[precision] = losses, host(state.params), grads
    return out


@pytest.mark.parametrize("precision,stage,mesh", SAMPLED, ids=["-".join(map(str, c)) for c in SAMPLED])
def test_ten_steps_match_one_device(corpus, reference, precision, stage, mesh):
    ref_losses, ref_params, _ = reference[precision]
    job = _job(corpus, precision, stage, mesh)
    losses, state = train(job, corpus)
    worst = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    print(f"{precision} stage {stage} {mesh}: largest relative loss difference {worst:.2e}")
    assert losses[-1] < losses[0] - 0.5, "the loss should fall over ten steps"
    if precision == "fp32":
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
        assert_close(job.state_plan.saved_form(state).params, ref_params, RTOL)
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=BF16_TEN_STEPS)


@pytest.mark.parametrize("stage,mesh", [(s, m) for p, s, m in SAMPLED if p == "bf16"])
def test_bf16_step_matches_one_device(corpus, reference, stage, mesh):
    """One bf16 step: the loss, and the float32 gradients (module docstring)."""
    _, _, (ref_loss, ref_grads) = reference["bf16"]
    job = _job(corpus, "bf16", stage, mesh)
    loss, grads = first_step(job, corpus)
    per_shard = grads_lib.unreduced_axes(job.state_plan, job.run.train.microbatches, job.reduce_once)
    split = "tensor" in mesh or "pipe" in mesh  # products summed across devices in bf16
    rtol = BF16_TENSOR_PARALLEL if split else BF16_PER_SHARD if per_shard else RTOL
    np.testing.assert_allclose(float(loss), ref_loss,
                               rtol=BF16_TENSOR_PARALLEL_LOSS if "tensor" in mesh else RTOL)
    assert_close(host(grads), ref_grads, rtol)


@pytest.mark.parametrize("stage", [1, 3] if FULL else [3])  # CI: the stage that shards most
def test_four_microbatches_equal_one_whole_batch(corpus, stage):
    """Loss and gradient accumulated over 4 microbatches equal those of the whole batch."""
    job = make_job(corpus, mesh="data=2,fsdp=4", zero_stage=stage, batch_size=32)
    state_plan = job.state_plan
    state = job.init_state()
    raw = corpus_lib.global_batch(corpus, "train", 32, 32, 0, 0, state_plan.batch_sharding)
    batch = grads_lib.weighted(raw)
    loss_fn = lambda p, b: grads_lib.lm_loss(job.model, job.hooks, p, b)[0]
    grads_sharding = state_plan.named(state_plan.specs.grads)
    constrain = lambda g: jax.lax.with_sharding_constraint(g, grads_sharding)
    micro_sharding = jax.sharding.NamedSharding(state_plan.mesh, jax.sharding.PartitionSpec(
        None, *state_plan.batch_sharding.spec))
    micro = lambda x: jax.lax.with_sharding_constraint(x, micro_sharding)
    four_once = make_job(corpus, mesh="data=2,fsdp=4", zero_stage=stage, batch_size=32,
                         microbatches=4, grad_reduce="step").jit_loss_and_grads()

    @jax.jit
    def both(params, batch):
        whole = accumulate.accumulate(jax.value_and_grad(loss_fn), params, batch, 1, constrain, micro)
        four = accumulate.accumulate(jax.value_and_grad(loss_fn), params, batch, 4, constrain, micro)
        return whole, four

    (loss1, g1), (loss4, g4) = both(state.params, batch)
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=RTOL)
    assert_close(g4, g1, RTOL)
    loss_p, g_p = four_once(state.params, raw)
    np.testing.assert_allclose(float(loss_p), float(loss1), rtol=RTOL)
    assert_close(g_p, g1, RTOL)


def test_accumulated_training_matches_one_device(corpus, reference):
    """Ten steps with --microbatches 2 (per-device partial sums, reduced once
    per step) equal ten whole-batch steps on one device."""
    ref_losses, ref_params, _ = reference["fp32"]
    losses, state = train(_job(corpus, "fp32", 1, "data=2,fsdp=4", microbatches=2), corpus)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_close(state.params, ref_params, RTOL)


def test_strided_split_keeps_rows_on_their_devices():
    x = np.arange(16 * 3).reshape(16, 3)
    micro = np.asarray(accumulate.split_microbatches(x, 4))
    assert micro.shape == (4, 4, 3)
    np.testing.assert_array_equal(micro[1, :, 0], x[1::4, 0])
