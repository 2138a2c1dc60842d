"""The compiled train step has the collectives each ZeRO stage promises."""

import re

import jax
import pytest

from tests.helpers import make_job
from zero_jax.analysis import hlo


@pytest.fixture(scope="module")
def hlo_text(corpus):
    return {s: make_job(corpus, zero_stage=s).compile_train_step().as_text() for s in (0, 3)}


def test_stage0_all_reduces_gradients_and_gathers_nothing(hlo_text):
    counts = hlo.counts(hlo_text[0])
    assert counts["all-reduce"] > 0
    assert counts["all-gather"] == 0


def test_stage3_gathers_parameters_one_layer_at_a_time(corpus, hlo_text):
    found = hlo.collectives(hlo_text[3])
    gathers = [c for c in found if c.op == "all-gather"]
    assert gathers, "stage 3 must all-gather parameters"
    # No gather materialises a whole stacked (layers, ...) weight: the scan
    # gathers each layer's slice inside the loop.
    job = make_job(corpus)
    stacked = {tuple(x.shape) for x in jax.tree.leaves(job.state_plan.abstract.params["blocks"])}
    for g in gathers:
        for shape in re.findall(r"f32\[([\d,]+)\]", g.line.split("all-gather")[0]):
            assert tuple(int(d) for d in shape.split(",")) not in stacked, g.line


def test_counts_parse_tuple_and_async_forms():
    text = """
  %all-reduce.6 = (f32[768]{0}, f32[3,6]{1,0}) all-reduce(%a, %b), channel_id=1
  %ag = bf16[8,4]{1,0} all-gather-start(%p), dimensions={0}
  %ag.done = bf16[8,4]{1,0} all-gather-done(%ag)
  ROOT %cp = f32[2]{0} collective-permute(%x), source_target_pairs={{0,1}}
"""
    assert hlo.counts(text) == {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 0,
                                "collective-permute": 1, "all-to-all": 0}
    assert hlo.collectives(text)[1].dtypes == ("bf16",)


def test_a_one_device_program_has_text_and_no_collectives(corpus):
    """XLA skips SPMD partitioning for one device (nothing is dumped): the
    plan reads the lowered HLO instead, which holds no collective."""
    job = make_job(corpus, mesh="fsdp=1", zero_stage=0, devices=jax.devices()[:1])
    _, text = hlo.compile_partitioned(job.lower_train_step())
    assert "ENTRY" in text and not re.search(r"all-(gather|reduce)\(", text)
