"""Why the actual shardings' bytes differ from the ZeRO formula's: each
cause priced leaf by leaf (analysis/formula_gap.py), its parts summing to
the whole."""

import math

import pytest

from tests.helpers import make_job
from zero_jax.analysis import formula_gap, memory
from zero_jax.sharding.specs import named_leaves


def _total_gap(state_plan) -> float:
    return sum(memory.sharded(state_plan).values()) - sum(memory.theory(state_plan).values())


def test_nothing_to_explain_where_every_array_divides(corpus):
    job = make_job(corpus, zero_stage=3, min_shard_elements=0)
    assert formula_gap.describe(job.state_plan) is None


def test_arrays_left_whole_cost_what_the_formula_divided(corpus):
    """fp32 Adam at ZeRO-3 over 8: an array of n elements left whole holds
    16 n bytes where the formula counts 16 n / 8."""
    job = make_job(corpus, zero_stage=3)
    state_plan = job.state_plan
    leaves = named_leaves(state_plan.abstract.params)
    whole = sum(math.prod(leaves[path].shape) for path, _ in state_plan.specs.replicated)
    rows = formula_gap.gap(state_plan)
    assert [(cause, arrays) for cause, _, arrays in rows] == [
        ("left whole by ZeRO", len(state_plan.specs.replicated))]
    assert rows[0][1] == pytest.approx(16 * whole * 7 / 8)
    assert rows[0][1] == pytest.approx(_total_gap(state_plan), abs=1024)
    assert formula_gap.describe(state_plan).startswith("why they differ: +")


def test_a_pipeline_stage_stores_its_own_layers(corpus):
    """Split over pipe the stacked layers take half the formula's bytes,
    which counts no pipe axis; tensor leaves norms and biases whole."""
    job = make_job(corpus, mesh="pipe=2,fsdp=2,tensor=2", layout="fsdp_tp_sp")
    rows = {cause: (b, n) for cause, b, n in formula_gap.gap(job.state_plan)}
    pipe = rows["split over pipe as well, each pipeline stage storing its own layers"]
    assert pipe[0] < 0 and pipe[1] > 0
    assert rows["not split over tensor"][0] > 0
    assert "other" not in rows
    assert sum(b for b, _ in rows.values()) == pytest.approx(_total_gap(job.state_plan), abs=1)

