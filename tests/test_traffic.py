"""Collective bytes per step, measured in the compiled program against the
ZeRO paper's volumes; one gradient reduction per step; hybrid sharding."""

import math

import jax
import numpy as np
import pytest

from tests.helpers import make_job, train
from tests.hlo_loops import inside_loops
from zero_jax.analysis import hlo
from zero_jax.analysis import memory
from zero_jax.analysis import traffic
from zero_jax.pipeline import executor as executor_lib

# bf16 compute, float32 gradients: g = 4 bytes, c = 2 bytes per parameter.
# The position table is as long as the sequence, so that every parameter is
# used: XLA reduces only the rows a step reads (a constant range) when it
# reduces on the spot, but whole tables when it reduces accumulated sums.
BF16 = dict(precision="bf16", batch_size=32, seq_len=32, max_seq_len=32)


def _measure(job):
    compiled, text = job.compile_with_text()
    return traffic.traffic(text, job.state_plan.mesh), text


@pytest.fixture(scope="module")
def fsdp8(corpus):
    """(stage, microbatches) -> (measured Traffic, theory, parameter count, HLO text)."""
    out = {}
    for stage, m in [(0, 4), (1, 1), (1, 4), (2, 4), (3, 1), (3, 4)]:
        job = make_job(corpus, zero_stage=stage, microbatches=m, **BF16)
        measured, text = _measure(job)
        theory = traffic.theory(job.state_plan, m, job.reduce_once, job.policy.dtype("compute"),
                                job.model.gathered_once)
        out[stage, m] = measured, theory, memory.param_count(job.state_plan), text
    return out


@pytest.mark.parametrize("stage,m", [(0, 4), (1, 1), (1, 4), (2, 4), (3, 1), (3, 4)])
def test_measured_bytes_match_the_zero_volumes(fsdp8, stage, m):
    measured, theory, psi, _ = fsdp8[stage, m]
    expected = sum(theory.values())
    print(f"stage {stage}, m={m}: measured {measured.total} B = {measured.total / psi:.3f} per "
          f"parameter; theory {expected} B = {expected / psi:.3f}; {measured.by_op}")
    assert measured.total == pytest.approx(expected, rel=0.05)
    assert measured.unknown_loops == 0


def test_accumulation_adds_no_traffic_below_stage_3(fsdp8):
    """One gradient reduction per optimizer step: 4 microbatches move what 1
    does (stages 0 and 2 too: they match their volumes, which do not depend on m)."""
    one, four = fsdp8[1, 1][0], fsdp8[1, 4][0]
    assert four.total == pytest.approx(one.total, rel=0.01), (one.by_op, four.by_op)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_collective_runs_inside_the_microbatch_loop(fsdp8, stage):
    text = fsdp8[stage, 4][3]
    inside = hlo.collectives(inside_loops(text))
    assert not inside, [c.line[:160] for c in inside]


def test_stage1_gathers_the_bf16_working_copy(fsdp8):
    """After the update each device casts its master shard to bf16: the
    all-gather moves 2 bytes per parameter (the sharded ones), not 4."""
    measured, _, psi, _ = fsdp8[1, 4]
    assert measured.of("all-gather") / psi == pytest.approx(2, rel=0.01)
    assert measured.of("all-reduce") / psi == pytest.approx(4, rel=0.01)  # float32 gradients


def test_stage3_accumulation_scales_only_the_gathers_when_reducing_once(corpus, fsdp8):
    """ZeRO-3 reduce-scatters each microbatch by default (the accumulator stays
    1/N); with --grad-reduce step everything but the gathers is as for m = 1."""
    one = fsdp8[3, 1][0]
    default = fsdp8[3, 4][0]
    once, _ = _measure(make_job(corpus, zero_stage=3, microbatches=4, grad_reduce="step", **BF16))
    psi = fsdp8[3, 1][2]
    assert once.of("all-gather") == pytest.approx(4 * one.of("all-gather"), rel=0.01)
    rest = lambda t: t.total - t.of("all-gather")
    assert rest(once) == pytest.approx(rest(one), rel=0.01)
    assert rest(default) == pytest.approx(4 * rest(one), rel=0.05)
    assert default.of("reduce-scatter") / psi == pytest.approx(16, rel=0.05)  # 4 x float32


def test_hybrid_sharding_reduces_shards_across_data(corpus):
    """ZeRO over fsdp only: gradients reduce-scattered over fsdp, then only the
    shards all-reduced over data; no gather crosses data; numerics as 1 device."""
    job = make_job(corpus, mesh="data=2,fsdp=4", zero_shard_axes="fsdp", zero_stage=3,
                   microbatches=2, batch_size=32, seq_len=32)
    measured, _ = _measure(job)
    grad_bytes = 4 * memory.param_count(job.state_plan)
    print(f"hybrid: {measured.by_op}; over data {measured.over('data')} B = "
          f"{measured.over('data') / grad_bytes:.4f} of the gradient bytes")
    assert measured.over("data") / grad_bytes == pytest.approx(1 / 4, rel=0.05)
    assert not [k for k in measured.by_op if k.startswith("all-gather") and "data" in k]
    ref, _ = train(make_job(corpus, mesh="fsdp=1", zero_stage=0, microbatches=2, batch_size=32,
                            seq_len=32, devices=jax.devices()[:1]), corpus, steps=5)
    losses, _ = train(job, corpus, steps=5)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_pipelined_gradients_are_reduced_once_per_step(corpus):
    """With stages over pipe, ZeRO-1's gradient all-reduce over the data axes
    moves each stage's gradients once per step (4 microbatches), float32:
    its layers' and its row block of the embedding and head tables."""
    job = make_job(corpus, mesh="pipe=2,fsdp=4", zero_stage=1, microbatches=4, **BF16)
    measured, _ = _measure(job)
    fns = job.model.pipeline
    (outer, stack), (outer_specs, stack_specs) = (fns.split(job.state_plan.abstract.params),
                                                  fns.split(job.state_plan.specs.compute))
    assert not executor_lib.tables_not_in_rows(outer, fns.split(job.state_plan.specs.params)[0])
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)

    def per_device(params, specs, blocks):
        return sum(4 * math.prod(jax.sharding.NamedSharding(job.state_plan.mesh, s).shard_shape(p.shape))
                   // (blocks if p.ndim >= 2 else 1)
                   for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=is_spec)))

    once = per_device(stack, stack_specs, 1) + per_device(outer, outer_specs, 2)
    assert measured.by_op["all-reduce@fsdp"] == pytest.approx(once, rel=0.001)


_SYNTHETIC = """
HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[8]{0} all-gather(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ag)
}

ENTRY %main (a: f32[16]) -> f32[2] {
  %a = f32[16]{0} parameter(0)
  %ar = f32[16]{0} all-reduce(%a), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %b = f32[16]{0} bitcast(%ar)
  %s = f32[2]{0} dynamic-slice(%b, %o), dynamic_slice_sizes={2}
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[2]{0} copy(%s)
}
"""


def test_loops_multiply_and_sliced_all_reduces_count_as_reduce_scatters(corpus):
    mesh = make_job(corpus, mesh="data=4,tensor=2", layout="fsdp_tp").state_plan.mesh
    t = traffic.traffic(_SYNTHETIC, mesh)
    assert t.by_op == {"all-gather@tensor": 3 * 32, "reduce-scatter@data,tensor": 64}
    assert t.rewritten == 1 and t.unknown_loops == 0
