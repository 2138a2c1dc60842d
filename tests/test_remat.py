"""Activation checkpointing: memory per policy, and a scanned stack that
compiles in the same time whatever its depth."""

import time

import pytest

from models import gpt
from tests.helpers import make_job
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import memory


@pytest.fixture(scope="module")
def temps(corpus):
    """Compiled temp bytes of a 12-layer model at sequence length 1024."""
    out = {}
    for policy in ("none", "full"):
        job = make_job(corpus, model="gpt-small", seq_len=1024, batch_size=8, remat=policy)
        out[policy] = (memory.compiled(job.compile_train_step())["temp_bytes"],
                       job.activation_estimate())
    return out


def test_full_remat_needs_at_most_a_third_of_none(temps):
    assert temps["full"][0] <= temps["none"][0] / 3, temps


def test_analytic_activations_order_and_scale_like_the_compiled_ones(temps):
    # The estimate counts activations only; the compiled figure adds the
    # backward pass's working set, so it is larger, but of the same order.
    for policy, (compiled, analytic) in temps.items():
        assert analytic < compiled < 3 * analytic, (policy, compiled, analytic)
    assert temps["full"][1] < temps["none"][1]


def _compiled(n_layer: int):
    run = config_lib.build(None, {"data.seq_len": 32, "train.batch_size": 16})
    cfg = gpt.model.config("gpt-tiny", 256, n_layer=n_layer)
    job = job_lib.prepare(run, lambda multiple: gpt.model.model_fns(cfg))
    start = time.perf_counter()
    text = job.compile_train_step().as_text()
    return text, time.perf_counter() - start


def test_compiled_program_does_not_grow_with_depth():
    """The layers are one scanned loop, so 48 layers compile to the program
    4 do (the loop's trip count aside): what keeps compile time flat in
    depth. Counted in instructions, not timed: a timing compared across two
    moments of a loaded machine measures the load."""
    (shallow, t4), (deep, t48) = _compiled(4), _compiled(48)
    print(f"compile: 4 layers {t4:.2f}s, 48 layers {t48:.2f}s")

    def instructions(text):
        return sum(" = " in line for line in text.splitlines())
    assert instructions(deep) <= 1.05 * instructions(shallow), (instructions(deep), instructions(shallow))
