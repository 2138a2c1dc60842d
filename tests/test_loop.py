"""The host loop: bounded steps in flight, records, evaluation."""

import functools

import numpy as np

from tests.helpers import make_job
from zero_jax import data as data_lib, loop


def test_many_steps_with_collectives_do_not_deadlock(corpus, tmp_path):
    """Unbounded dispatch deadlocks XLA's CPU collectives within ~400 steps
    (project facts); the loop keeps two steps in flight and must get through."""
    job = make_job(corpus, seq_len=8, batch_size=8, steps=400, zero_stage=3)
    t = job.run.train
    batch = functools.partial(data_lib.global_batch, corpus, "train", 8, 8, 0,
                              sharding=job.layout.batch_sharding)
    evals = []

    def eval_fn(params):
        evals.append(1)
        return 1.0

    state, history = loop.train(job.init_state(), job.compile_train_step(),
                                lambda s: batch(step=s), steps=t.steps, eval_fn=eval_fn,
                                eval_every=150, metrics_path=str(tmp_path / "m.jsonl"),
                                progress=False)
    assert int(state.step) == 400
    assert [r["step"] for r in history] == list(range(1, 401))
    assert len(evals) == 3  # after steps 150, 300 and the last
    assert [r["step"] for r in history if "val_loss" in r] == [150, 300, 400]
    assert np.isfinite([r["loss"] for r in history]).all()
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 400
