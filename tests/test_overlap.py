"""ZeRO-3's per-layer collectives sit inside the layer scan, where XLA:GPU's
collective pipeliner can overlap them with compute (zero_jax/sharding/overlap.py),
and the step carries the options that ask for it."""

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import compile_step, make_job
from tests.hlo_loops import inside_loops
from zero_jax.sharding import overlap
from zero_jax.train import step
from zero_jax.runtime import xla_options
from zero_jax.analysis import hlo


def _in_loops_and_after(job):
    text = compile_step(job).as_text()
    inside = hlo.counts(inside_loops(text))
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


def test_the_step_asks_for_the_overlap_only_at_zero3_on_gpu(corpus):
    job = make_job(corpus, zero_stage=3)
    on_gpu = step.compiler_options(job.state_plan, overlap=True, backend="gpu")
    assert set(on_gpu) == {xla_options.accepted(w)[0] for w in overlap.ZERO3_WANTS}
    assert step.compiler_options(job.state_plan, overlap=False, backend="gpu") is None
    assert step.compiler_options(make_job(corpus, zero_stage=2).state_plan, overlap=True,
                                 backend="gpu") is None
    # Other backends are not asked: their programs (and cache keys) stay free of it.
    assert step.compiler_options(job.state_plan, overlap=True, backend="cpu") is None
    # XLA reads every backend's options on any backend: the step as spelled
    # for the GPU compiles here with this XLA.
    job.lower_train_step().compile(compiler_options=on_gpu)


def test_every_want_has_a_spelling_this_xla_knows():
    # XLA rejects an option it does not know ("No such compile option"), so a
    # rename in a new jaxlib shows here rather than as a slower GPU step.
    for want in (*overlap.ZERO3_WANTS, xla_options.WHILE_LOOP_DOUBLE_BUFFERING):
        assert xla_options.accepted(want) == want.spellings[0], want
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        lowered.compile(compiler_options={"xla_gpu_no_such_option": True})


def test_a_want_this_xla_does_not_know_is_left_out_with_a_warning():
    unknown = xla_options.Want("gpu", (("xla_gpu_no_such_option", True),))
    with pytest.warns(RuntimeWarning, match="xla_gpu_no_such_option"):
        assert xla_options.spell((unknown, xla_options.PIPELINE_ALL_GATHER), "gpu") == dict(
            [xla_options.PIPELINE_ALL_GATHER.spellings[0]])
