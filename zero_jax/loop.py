"""The host loop: data -> step -> metrics -> eval, with two steps in flight.

Step t + 1 is dispatched before the metrics of step t are read, so the host
builds the next batch and logs while the device computes. It never runs
further ahead than that: dispatching many steps of a program with
collectives without waiting deadlocks XLA's CPU collectives (see the
deadlock note in the project facts), and one step of lookahead is all the
overlap a training loop needs.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

import jax
from tqdm import tqdm

from zero_jax.runtime import metrics as metrics_lib
from zero_jax.runtime.distributed import local
from zero_jax.analysis.flops import Throughput
from zero_jax.runtime.metrics import MetricsWriter, TensorBoardWriter
from zero_jax.runtime.trace import Tracer
from zero_jax.state import TrainState
from zero_jax.runtime.watchdog import StepWatchdog


class TrainingHalted(RuntimeError):
    """Training stopped because too many steps in a row had non-finite gradients."""


def evaluate(eval_step: Callable, params: Any, batches: Callable[[int], Any], n: int,
             targets: Callable[[int], int] = lambda i: 1) -> float:
    """Mean loss over the targets of `n` validation batches, one in flight at
    a time: each batch's mean weighted by its count of `targets`."""
    total = count = 0.0
    for i in range(n):
        loss = float(local(eval_step(params, batches(i))))  # waits: one batch in flight
        total, count = total + loss * targets(i), count + targets(i)
    return total / max(count, 1)


def train(state: TrainState, train_step: Callable, batch_at: Callable[[int], jax.Array], *,
          steps: int, eval_fn: Callable[[Any], float] | None = None, eval_every: int = 0,
          metrics_path: str = "", out: TextIO = sys.stdout, progress: bool = True,
          max_consecutive_skips: int = 20,
          after_step: Callable[[int, TrainState], bool] | None = None,
          watchdog: StepWatchdog | None = None, throughput: Throughput | None = None,
          tensorboard_dir: str = "", tracer: Tracer | None = None,
          ) -> tuple[TrainState, list[dict[str, Any]]]:
    """Run `train_step` from `state.step` to `steps`; returns the state and per-step records.

    `batch_at(step)` builds the global batch of a step; `eval_fn(params)`
    returns the validation loss, run every `eval_every` steps and at the end.
    `after_step(n, state)` is called with the state after n steps, before the
    next step is dispatched (and may donate it), so it can save that state;
    it returns True to stop there. Raises TrainingHalted after
    `max_consecutive_skips` skipped steps in a row. `watchdog` is told when
    the loop starts and stops waiting on each step. `throughput` adds
    FLOP/s per device and MFU to each record; `tensorboard_dir` writes the
    records' scalars there too; `tracer` profiles its window of steps.
    """
    start = int(local(state.step))
    writers = (MetricsWriter(metrics_path, start), TensorBoardWriter(tensorboard_dir, start))
    bar = tqdm(total=steps, initial=start, file=out, disable=not progress, dynamic_ncols=True,
               mininterval=1.0, unit="step")
    history: list[dict[str, Any]] = []
    pending: tuple[int, dict[str, jax.Array]] | None = None
    last_done = time.perf_counter()

    def finish(step: int, metrics: dict[str, jax.Array], eval_params: Any = None) -> None:
        nonlocal last_done
        # Wait for this step on every device, not only the one the replicated
        # metrics are read from: the bound must hold per device.
        if watchdog is not None:
            watchdog.started(step)
        values = local(jax.block_until_ready(metrics))
        if watchdog is not None:
            watchdog.finished(step)
        now = time.perf_counter()
        record = {"step": step + 1, "loss": float(values["loss"]),
                  "grad_norm": float(values["grad_norm"]), "lr": float(values["lr"]),
                  "tokens_per_s": float(values["tokens"]) / (now - last_done),
                  "step_time_s": now - last_done, "loss_scale": float(values["loss_scale"]),
                  "skipped": bool(values["skipped"])}
        if throughput is not None:
            record.update(throughput.fields(record["tokens_per_s"]))
        record.update(metrics_lib.memory())
        if record["skipped"]:
            run = int(values["consecutive_skips"])
            bar.write(f"step {record['step']}: non-finite gradients (norm {record['grad_norm']}), "
                      f"update skipped, {run} in a row; loss scale was {record['loss_scale']:g}")
            if run >= max_consecutive_skips:
                history.append(record)
                for writer in writers:
                    writer.write(record)
                raise TrainingHalted(
                    f"stopped at step {record['step']}: {run} steps in a row had non-finite "
                    f"gradients (limit --max-consecutive-skips {max_consecutive_skips}); the "
                    "parameters are those of the last finite step. Lower the learning rate, "
                    "check the data, or train in bf16 instead of fp16")
            eval_params = None  # evaluate finite states only
        if eval_params is not None:
            record["val_loss"] = eval_fn(eval_params)
            bar.write(f"step {record['step']}: val_loss {record['val_loss']:.4f}")
            now = time.perf_counter()  # eval time is not step time
        history.append(record)
        for writer in writers:
            writer.write(record)
        mfu = {"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                        **mfu, step_s=f"{record['step_time_s']:.3f}", refresh=False)
        bar.update(1)
        last_done = now

    def eval_after(n: int) -> bool:
        return eval_fn is not None and (n == steps or (eval_every > 0 and n % eval_every == 0))

    try:
        for step in range(start, steps):
            if tracer is not None and tracer.at_edge(step):
                # Nothing in flight at either edge: the trace holds its steps only.
                if pending is not None:
                    finish(*pending)
                    pending = None
                tracer.toggle()
                last_done = time.perf_counter()  # writing the trace is not step time
            state, metrics = train_step(state, batch_at(step))
            if pending is not None:
                finish(*pending)
            pending = (step, metrics)
            if eval_after(step + 1):  # drain, then evaluate the state this step produced
                finish(step, metrics, state.params)
                pending = None
            if after_step is not None and after_step(step + 1, state):
                break
        if pending is not None:
            finish(*pending)
    finally:
        if tracer is not None:
            tracer.stop()
        bar.close()
        for writer in writers:
            writer.close()
    return state, history
