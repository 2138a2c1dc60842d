"""The host loop: at most two steps in flight, records, evaluation, early stop."""

import functools

import jax
import numpy as np

from tests.helpers import initial_state, make_job
from zero_jax import loop
from zero_jax.data import corpus as data_lib


def _setup(corpus, steps):
    job = make_job(corpus, seq_len=8, batch_size=8, steps=steps, zero_stage=3)
    batch = functools.partial(data_lib.global_batch, corpus, "train", 8, 8, 0,
                              sharding=job.layout.batch_sharding)
    return job, job.compile_train_step(), lambda s: batch(step=s)


def test_never_more_than_two_steps_in_flight(corpus, tmp_path):
    """Unbounded dispatch deadlocks XLA's CPU collectives within a few hundred
    steps (project facts). When step t + 1 is dispatched, every output of step
    t - 1 must already be computed."""
    job, step_fn, batch = _setup(corpus, 30)
    outputs, ready_at_dispatch = [], []

    def watched(state, b):
        if len(outputs) >= 2:
            ready_at_dispatch.append(all(x.is_ready() for x in jax.tree.leaves(outputs[-2])))
        out = step_fn(state, b)
        outputs.append(out[1])
        return out

    evals = []
    state, history = loop.train(initial_state(job), watched, batch, steps=30,
                                eval_fn=lambda p: evals.append(1) or 1.0, eval_every=10,
                                metrics_path=str(tmp_path / "m.jsonl"), progress=False)
    assert len(ready_at_dispatch) == 28 and all(ready_at_dispatch)
    assert int(state.step) == 30 and [r["step"] for r in history] == list(range(1, 31))
    assert [r["step"] for r in history if "val_loss" in r] == [10, 20, 30] and len(evals) == 3
    assert np.isfinite([r["loss"] for r in history]).all()
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 30


def test_after_step_sees_each_state_and_can_stop(corpus):
    job, step_fn, batch = _setup(corpus, 20)
    seen = []

    def after_step(n, state):
        seen.append((n, int(state.step)))
        return n == 7

    state, history = loop.train(initial_state(job), step_fn, batch, steps=20, progress=False,
                                after_step=after_step)
    assert seen == [(n, n) for n in range(1, 8)]
    assert int(state.step) == 7 and len(history) == 7


def test_metrics_are_strict_json_and_a_resume_writes_each_step_once(tmp_path):
    import json
    import math

    path = str(tmp_path / "m.jsonl")
    first = loop.MetricsWriter(path)
    for step in range(1, 6):
        first.write({"step": step, "loss": math.nan if step == 3 else 1.0 / step})
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # cut short by a crash
    records = [json.loads(line) for line in open(path).read().splitlines()[:5]]
    assert records[2] == {"step": 3, "loss": None, "non_finite": ["loss"]}
    resumed = loop.MetricsWriter(path, start=4)  # the checkpoint was at step 4
    for step in range(5, 8):
        resumed.write({"step": step, "loss": 0.1})
    resumed.close()
    steps = [json.loads(line)["step"] for line in open(path)]
    assert steps == [1, 2, 3, 4, 5, 6, 7]
