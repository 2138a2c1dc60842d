"""The host loop: at most two steps in flight, records, evaluation, early stop."""

import functools
import io
import time

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers import initial_state, make_job
from zero_jax import loop
from zero_jax.data import corpus as corpus_lib
from zero_jax.runtime import trace
from zero_jax.runtime.metrics import MetricsWriter, Writers
from zero_jax.runtime.watchdog import StepWatchdog


QUIET = loop.Observers(progress=False)


def _setup(corpus, steps):
    job = make_job(corpus, seq_len=8, batch_size=8, steps=steps, zero_stage=3)
    batch = functools.partial(corpus_lib.global_batch, corpus, "train", 8, 8, 0,
                              sharding=job.state_plan.batch_sharding)
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
    metrics = Writers(MetricsWriter(str(tmp_path / "m.jsonl")))
    state, history = loop.train(initial_state(job), watched, batch, steps=30,
                                evaluation=loop.Evaluation(lambda p: evals.append(1) or 1.0, 10),
                                observers=loop.Observers(writers=metrics, progress=False))
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

    state, history = loop.train(initial_state(job), step_fn, batch, steps=20,
                                after_step=after_step, observers=QUIET)
    assert seen == [(n, n) for n in range(1, 8)]
    assert int(state.step) == 7 and len(history) == 7


def test_metrics_are_strict_json_and_a_resume_writes_each_step_once(tmp_path):
    import json
    import math

    path = str(tmp_path / "m.jsonl")
    first = MetricsWriter(path)
    for step in range(1, 6):
        first.write({"step": step, "loss": math.nan if step == 3 else 1.0 / step})
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # cut short by a crash
    records = [json.loads(line) for line in open(path).read().splitlines()[:5]]
    assert records[2] == {"step": 3, "loss": None, "non_finite": ["loss"]}
    resumed = MetricsWriter(path, start=4)  # the checkpoint was at step 4
    for step in range(5, 8):
        resumed.write({"step": step, "loss": 0.1})
    resumed.close()
    steps = [json.loads(line)["step"] for line in open(path)]
    assert steps == [1, 2, 3, 4, 5, 6, 7]


def test_the_watchdog_times_whole_steps_not_only_the_wait_on_them(corpus):
    """On a backend whose dispatch blocks, a step's time is spent before the
    wait on its results; a watchdog that timed only the wait saw medians near
    zero and stopped a healthy run at the first step whose time fell in the
    wait instead. It watches the interval the records time."""
    job, step_fn, batch = _setup(corpus, 10)

    @jax.jit
    def late(loss):  # long enough that the host waits on it
        a = jax.lax.fori_loop(0, 200, lambda i, a: jnp.tanh(a @ a), jnp.full((512, 512), 1e-3))
        return loss + 0 * a[0, 0]

    def step(state, b):
        state, metrics = step_fn(state, b)
        if int(jax.device_get(state.step)) == 10:  # the last step's time falls in the wait
            return state, {**metrics, "loss": late(metrics["loss"])}
        jax.block_until_ready(metrics)
        time.sleep(0.3)  # the others' in a dispatch that blocks
        return state, metrics

    out, exits = io.StringIO(), []
    # Stopped by a median of waits (about 0 s) at min_s; by whole steps, at
    # 20 x 0.3 s, past the last step's compile of `late` and its run.
    watchdog = StepWatchdog(warn=10, stop=20, min_s=0.3, out=out, exit_fn=exits.append,
                            poll_s=0.01)
    _, history = loop.train(initial_state(job), step, batch, steps=10,
                            observers=loop.Observers(progress=False, watchdog=watchdog))
    watchdog.close()
    assert exits == [] and "error" not in out.getvalue(), out.getvalue()
    assert len(history) == 10


def test_a_long_save_or_trace_is_not_a_stuck_step(corpus, tmp_path):
    """What runs between steps (a checkpoint save in after_step, a trace
    started and written) is bounded by its own limits: a loaded host that
    spends many step medians in it must not trip the watchdog."""
    job, step_fn, batch = _setup(corpus, 9)

    def slow_save(n, state):
        if n == 8:
            time.sleep(2.0)  # 2 x min_s: past the stop limit, were it watched
        return False

    # Both after the first steps, once the watchdog knows a median. The
    # limits are max(min_s, x median): min_s is a second so that a step the
    # host's load slows (a 0.14 s step once took 0.45 s with the suite and
    # other work on 2 cores) is not what trips it, while the save would.
    tracer = trace.Tracer(trace.Window(6, 7), str(tmp_path / "trace"), log=lambda line: None)
    out, exits = io.StringIO(), []
    watchdog = StepWatchdog(warn=2, stop=3, min_s=1.0, out=out, exit_fn=exits.append,
                            poll_s=0.01)
    _, history = loop.train(initial_state(job), step_fn, batch, steps=9, after_step=slow_save,
                            observers=loop.Observers(progress=False, watchdog=watchdog,
                                                     tracer=tracer))
    watchdog.close()
    assert exits == [] and "error" not in out.getvalue(), out.getvalue()
    assert len(history) == 9
