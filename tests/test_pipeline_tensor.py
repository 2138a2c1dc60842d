"""A pipeline with tensor parallelism (BLOOM's 3D layout, `pipe` x `tensor`)
against one device, and the lookup that lets XLA partition it.

Inside the pipeline's shard_map (manual over `pipe`) the embedding table's
rows are split over `tensor` too. From jaxlib 0.11.2, XLA's SPMD partitioner
aborts the process on a gather from such rows there (a check in its device
groups, `spmd_partitioner_util.cc`; docs/pipelines.md has the reproduction),
so the lookup splits them by hand (param_use.ManualRows). These tests are in
the core that runs on the oldest JAX too (tests/core.txt).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tests.helpers import assert_close, host, make_job, train
from zero_jax.model import param_use

COMMON = dict(seq_len=16, batch_size=16, n_layer=4, microbatches=4)


@pytest.fixture(scope="module")
def reference(corpus):
    losses, state = train(make_job(corpus, **COMMON, mesh="fsdp=1", devices=jax.devices()[:1]),
                          corpus)
    return losses, host(state.params)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_pipe_fsdp_tensor_trains_like_one_device(corpus, reference, schedule):
    job = make_job(corpus, **COMMON, mesh="pipe=2,fsdp=2,tensor=2", pipeline_schedule=schedule)
    losses, state = train(job, corpus)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_close(host(job.state_plan.saved_form(state).params), reference[1])


@pytest.mark.parametrize("vmapped", [False, True])
def test_a_lookup_of_rows_split_inside_a_manual_region_matches_take(vmapped):
    """The construct itself: a (256, 64) table split over `pipe` in blocks,
    each block's rows split over `tensor`, ids split over `fsdp`; the rows
    read by hand and their gradient, against jnp.take on one device. With
    `vmapped`, under a vmap over batch shards laid out on `fsdp`, as a
    pipeline's per-shard gradients run it."""
    mesh = jax.make_mesh((2, 2, 2), ("pipe", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rows = param_use.ManualRows(("tensor",), widen=True, vmapped=("fsdp",) if vmapped else ())
    use = param_use.Use(None, NamedSharding(mesh, P("tensor", None)), jnp.float32, jnp.float32,
                        jnp.float32, None, manual_rows=rows)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((256, 64)).astype(np.float32)
    ids = rng.integers(0, 256, (2, 4, 32)).astype(np.int32)  # (shards, rows, sequence)
    w = rng.standard_normal((2, 4, 32, 64)).astype(np.float32)

    def stage(block, ids, w):  # one `pipe` block of the table: its rows' share of the loss
        def shard(ids, w):
            at, inside = param_use.block_rows(ids, jax.lax.axis_index("pipe") * 128, 128)
            y = param_use.lookup(use, jnp.float32, block, at)
            return jnp.sum(jnp.where(inside[..., None], y, 0.0) * w)
        ids = jax.lax.with_sharding_constraint(ids, NamedSharding(mesh, P("fsdp")))
        if vmapped:
            return jax.vmap(shard, spmd_axis_name="fsdp")(ids, w).sum()[None]
        return shard(ids, w)[None]

    @jax.jit
    def loss(table):
        per_stage = jax.shard_map(stage, mesh=mesh, in_specs=(P("pipe"), P(), P()),
                                  out_specs=P("pipe"), axis_names={"pipe"}, check_vma=False)
        return per_stage(table, ids, w).sum()

    value, grad = jax.value_and_grad(loss)(table)
    expected, expected_grad = jax.value_and_grad(
        lambda t: jnp.sum(jnp.take(t, ids, axis=0) * w))(table)
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=1e-5, atol=1e-5)
