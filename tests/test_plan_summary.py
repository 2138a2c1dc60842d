"""The plan printed before training (analysis/summary.py): one screen by
default, every parameter's layout and pipeline tick under --plan full."""

import pytest

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.report import summary
from zero_jax.sharding.specs import named_leaves


@pytest.fixture(scope="module")
def main_job():
    """`make train`'s job (the defaults: gpt-tiny, ZeRO-3 on cpu-8), compiled."""
    run = config_lib.build(None, {})
    job = job_lib.prepare(run, models.for_run(run.model, 256)[0])
    return job, *job.compile_with_text()


def _describe(job, compiled, text, plan):
    job = job_lib.prepare(config_lib.build(None, {"train.plan": plan}),
                          models.for_run(job.run.model, 256)[0])
    return summary.describe(job, "stdlib", "gpt-tiny", compiled, text).splitlines()


def test_the_main_jobs_plan_fits_one_screen(main_job):
    lines = _describe(*main_job, "summary")
    assert len(lines) <= 30, "\n".join(lines)
    text = "\n".join(lines)
    for part in ("mesh       cpu-8: 8 devices", "placement  fsdp: inside each host",
                 "zero       stage 3 over fsdp (N_d=8)", "the model states exact",
                 "compiled step, measured", "collectives ", "largest parameters per device"):
        assert part in text, part
    # The shardings differ from the formula (small arrays left whole): why, on their line.
    row = next(line for line in lines if line.startswith("  actual shardings"))
    assert "why they differ: +" in row and "left whole by ZeRO" in row
    assert "state layout per device" not in text


def test_plan_full_lists_every_parameter(main_job):
    job = main_job[0]
    text = "\n".join(_describe(*main_job, "full"))
    assert "state layout per device" in text
    for path in named_leaves(job.state_plan.abstract.params):
        assert f"\n  {path} " in text, path


def test_an_estimate_above_the_compiled_figure_says_it_is_a_bound():
    below = summary.activation_line({"analytic_bytes": 2**20, "compiled_temp_bytes": 2**21})
    above = summary.activation_line({"analytic_bytes": 2**21, "compiled_temp_bytes": 2**20})
    assert "below the compiled temporaries (2.00)" in below
    assert "2.00 estimated, an upper bound: the compiled temporaries (1.00)" in above
