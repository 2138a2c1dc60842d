"""ZeRO-3's per-layer collectives sit inside the layer scan, where XLA:GPU's
collective pipeliner can overlap them with compute (zero_jax/overlap.py),
and the step carries the options that ask for it."""

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import compile_step, make_job
from zero_jax import overlap, step
from zero_jax.analysis import hlo


def _in_loops_and_after(job):
    text = compile_step(job).as_text()
    inside = hlo.counts(hlo.inside_loops(text))
    return inside, hlo.counts(text)


def test_zero3_gathers_and_reduces_each_layer_inside_the_scan(corpus):
    inside, _ = _in_loops_and_after(make_job(corpus, zero_stage=3))
    # The weights' gather runs per iteration, forward and backward; so does the
    # gradient's reduction (an all-reduce on CPU, whose compiler keeps no
    # reduce-scatter; XLA:GPU makes it one).
    assert inside["all-gather"] >= 2, inside
    assert inside["all-reduce"] + inside["reduce-scatter"] >= 1, inside


def test_below_zero3_the_scan_holds_no_collective(corpus):
    inside, whole = _in_loops_and_after(make_job(corpus, zero_stage=2))
    assert sum(inside.values()) == 0, inside
    assert whole["all-reduce"] + whole["reduce-scatter"] >= 1, whole  # after the loop


def test_the_step_compiles_with_the_options_only_at_zero3(corpus):
    job = make_job(corpus, zero_stage=3)
    assert step.compiler_options(job.layout, overlap=True) == overlap.ZERO3_OPTIONS
    assert step.compiler_options(job.layout, overlap=False) is None
    assert step.compiler_options(make_job(corpus, zero_stage=2).layout, overlap=True) is None
    off = make_job(corpus, zero_stage=3, overlap_collectives=False)
    # jax keeps a jit's compiler options on the lowering and merges them into the compile.
    kept = dict(job.lower_train_step()._lowering._compiler_options_kvs)
    assert overlap.ZERO3_OPTIONS.items() <= kept.items()
    assert not overlap.ZERO3_OPTIONS.keys() & dict(off.lower_train_step()._lowering._compiler_options_kvs).keys()


def test_this_xla_knows_every_option():
    # XLA rejects an option it does not know ("No such compile option"), so a
    # rename in a new jaxlib fails here rather than in a user's first GPU step.
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
    lowered.compile(compiler_options=overlap.ZERO3_OPTIONS)
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        lowered.compile(compiler_options={"xla_gpu_no_such_option": True})
