"""Every ZeRO stage on every mesh trains like one device (fp32, rtol 1e-5)."""

import jax
import numpy as np
import pytest

from tests.helpers import assert_close, host, make_job, train
from zero_jax import accumulate, step as step_lib

MESHES = ["fsdp=8", "data=2,fsdp=4", "data=8"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def reference(corpus):
    job = make_job(corpus, mesh="fsdp=1", zero_stage=0, devices=jax.devices()[:1])
    losses, state = train(job, corpus)
    return losses, host(state.params)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ten_steps_match_one_device(corpus, reference, mesh, stage):
    ref_losses, ref_params = reference
    losses, state = train(make_job(corpus, mesh=mesh, zero_stage=stage), corpus)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_close(state.params, ref_params, RTOL)
    assert losses[-1] < losses[0] - 0.5, "the loss should fall over ten steps"


@pytest.mark.parametrize("stage", [1, 3])
def test_four_microbatches_equal_one_whole_batch(corpus, stage):
    """Loss and gradient accumulated over 4 microbatches equal those of the whole batch."""
    job = make_job(corpus, mesh="data=2,fsdp=4", zero_stage=stage, batch_size=32)
    layout = job.layout
    state = job.init_state()
    from zero_jax import data as data_lib
    batch = data_lib.global_batch(corpus, "train", 32, 32, 0, 0, layout.batch_sharding)
    loss_fn = lambda p, b: step_lib.lm_loss(job.model, job.hooks, p, b)
    grads_sharding = layout.named(layout.specs.grads)
    constrain = lambda g: jax.lax.with_sharding_constraint(g, grads_sharding)
    micro_sharding = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec(
        None, *layout.batch_sharding.spec))
    micro = lambda x: jax.lax.with_sharding_constraint(x, micro_sharding)

    @jax.jit
    def both(params, batch):
        whole = accumulate.accumulate(jax.value_and_grad(loss_fn), params, batch, 1, constrain, micro)
        four = accumulate.accumulate(jax.value_and_grad(loss_fn), params, batch, 4, constrain, micro)
        return whole, four

    (loss1, g1), (loss4, g4) = both(state.params, batch)
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=RTOL)
    assert_close(g4, g1, RTOL)


def test_accumulated_training_matches_whole_batch_training(corpus):
    """Ten steps with --microbatches 4 equal ten steps without."""
    whole, s1 = train(make_job(corpus, batch_size=32, microbatches=1), corpus)
    four, s4 = train(make_job(corpus, batch_size=32, microbatches=4), corpus)
    np.testing.assert_allclose(four, whole, rtol=RTOL)
    assert_close(s4.params, s1.params, RTOL)


def test_strided_split_keeps_rows_on_their_devices():
    x = np.arange(16 * 3).reshape(16, 3)
    micro = np.asarray(accumulate.split_microbatches(x, 4))
    assert micro.shape == (4, 4, 3)
    np.testing.assert_array_equal(micro[1, :, 0], x[1::4, 0])
