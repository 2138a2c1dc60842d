"""The host loop: data -> step -> metrics -> eval, with two steps in flight.

Step t + 1 is dispatched before the metrics of step t are read, so the host
builds the next batch and logs while the device computes. It never runs
further ahead than that: dispatching many steps of a program with
collectives without waiting deadlocks XLA's in-process CPU collectives
(measured: every device count tried hung within 400 steps, and XLA aborted
the process), and one step of lookahead is all the overlap a training loop
needs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, TextIO

import jax
from tqdm import tqdm

from zero_jax.runtime import metrics as metrics_lib
from zero_jax.runtime.distributed import local
from zero_jax.analysis.flops import Throughput
from zero_jax.runtime.metrics import Writers
from zero_jax.runtime.trace import Tracer
from zero_jax.train.state import TrainState
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


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The validation a run does between its steps."""

    loss: Callable[[Any], float]  # params -> the validation loss
    every: int = 0  # steps between evaluations (0: none before the last step, always evaluated)


@dataclasses.dataclass(frozen=True)
class Observers:
    """What watches the steps from the host, none of it changing them."""

    # Where each record goes (metrics.Writers, opened at the state's step).
    writers: Writers = dataclasses.field(default_factory=Writers)
    progress: bool = True  # a progress bar on `out`
    out: TextIO = sys.stdout  # the progress bar's and the loop's lines
    watchdog: StepWatchdog | None = None  # times each step over the interval its record times
    throughput: Throughput | None = None  # FLOP/s per device and MFU in each record
    tracer: Tracer | None = None  # profiles its window of steps


class StepLog:
    """What the host does with a step once it has finished: wait for it on
    every device, time it, make its record (throughput, memory, validation
    loss when asked), halt after too many skipped steps, write the record
    and move the progress bar."""

    def __init__(self, start: int, steps: int, observers: Observers, max_consecutive_skips: int,
                 eval_fn: Callable[[Any], float] | None):
        self.writers = observers.writers
        self.bar = tqdm(total=steps, initial=start, file=observers.out,
                        disable=not observers.progress, dynamic_ncols=True, mininterval=1.0,
                        unit="step")
        self.max_consecutive_skips, self.eval_fn = max_consecutive_skips, eval_fn
        self.watchdog, self.throughput = observers.watchdog, observers.throughput
        self.history: list[dict[str, Any]] = []
        self.restart_clock(start)

    def restart_clock(self, step: int) -> None:
        """Time from now on counts toward step `step` (not a trace's writing)."""
        self.last_done = time.perf_counter()
        self.watch(step)

    def pause(self) -> None:
        """Nothing the watchdog should time runs until the next `watch`."""
        if self.watchdog is not None:
            self.watchdog.idle()

    def resume(self, step: int) -> None:
        """The watchdog counts what remains of step `step`, under way before
        a pause, from now (watched; not a sample of its median)."""
        if self.watchdog is not None:
            self.watchdog.started(step, resumed=True)

    def watch(self, step: int) -> None:
        """The watchdog counts step `step` from now. It watches the interval the
        records time, from the end of one step to the end of the next, not only
        the wait on a step's results: on a backend whose dispatch blocks, the
        wait is near zero for most steps, and a median of waits would stop a
        healthy run at the first step whose time falls in the wait instead."""
        if self.watchdog is not None:
            self.watchdog.started(step)

    def finish(self, step: int, metrics: dict[str, jax.Array], eval_params: Any = None) -> None:
        """Record step `step` (0-based); with `eval_params`, evaluate them too."""
        # Wait for this step on every device, not only the one the replicated
        # metrics are read from: the bound must hold per device.
        values = local(jax.block_until_ready(metrics))
        if self.watchdog is not None:
            self.watchdog.finished(step)
        now = time.perf_counter()
        record = self._record(step, values, now - self.last_done)
        if record["skipped"]:
            self._skipped(record, int(values["consecutive_skips"]))
            eval_params = None  # evaluate finite states only
        if eval_params is not None:
            record["val_loss"] = self.eval_fn(eval_params)
            self.bar.write(f"step {record['step']}: val_loss {record['val_loss']:.4f}")
            now = time.perf_counter()  # eval time is not step time
        self._write(record)
        mfu = {"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                             **mfu, step_s=f"{record['step_time_s']:.3f}", refresh=False)
        self.bar.update(1)
        self.last_done = now
        self.watch(step + 1)  # evaluation is not the next step's time either

    def _record(self, step: int, values: dict[str, Any], seconds: float) -> dict[str, Any]:
        record = {"step": step + 1, "loss": float(values["loss"]),
                  "grad_norm": float(values["grad_norm"]), "lr": float(values["lr"]),
                  "tokens_per_s": float(values["tokens"]) / seconds,
                  "step_time_s": seconds, "loss_scale": float(values["loss_scale"]),
                  "skipped": bool(values["skipped"])}
        if "expert_load" in values:  # a mixture of experts: the router's losses and load
            load = [float(x) for x in values["expert_load"]]
            record.update(aux_loss=float(values["aux_loss"]), z_loss=float(values["z_loss"]),
                          expert_load=load, expert_load_max=max(load))
        if "mtp_loss" in values:
            record["mtp_loss"] = float(values["mtp_loss"])
        if self.throughput is not None:
            record.update(self.throughput.fields(record["tokens_per_s"]))
        record.update(metrics_lib.memory())
        return record

    def _skipped(self, record: dict[str, Any], run: int) -> None:
        """Report a skipped step; past the limit, write its record and halt."""
        self.bar.write(f"step {record['step']}: non-finite gradients (norm {record['grad_norm']}), "
                       f"update skipped, {run} in a row; loss scale was {record['loss_scale']:g}")
        if run >= self.max_consecutive_skips:
            self._write(record)
            raise TrainingHalted(
                f"stopped at step {record['step']}: {run} steps in a row had non-finite "
                f"gradients (limit --max-consecutive-skips {self.max_consecutive_skips}); the "
                "parameters are those of the last finite step. Lower the learning rate, "
                "check the data, or train in bf16 instead of fp16")

    def _write(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.writers.write(record)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.idle()  # what follows the loop (a last save) is no step
        self.bar.close()
        self.writers.close()


def train(state: TrainState, train_step: Callable, batch_at: Callable[[int], jax.Array], *,
          steps: int, evaluation: Evaluation | None = None,
          after_step: Callable[[int, TrainState], bool] | None = None,
          max_consecutive_skips: int = 20,
          observers: Observers = Observers()) -> tuple[TrainState, list[dict[str, Any]]]:
    """Run `train_step` from `state.step` to `steps`; returns the state and per-step records.

    `batch_at(step)` builds the global batch of a step; `evaluation` runs
    every `evaluation.every` steps and at the end. `after_step(n, state)`
    is called with the state after n steps, before the next step is
    dispatched (and may donate it), so it can save that state; it returns
    True to stop there. Raises TrainingHalted after `max_consecutive_skips`
    skipped steps in a row. `observers` (Observers) watch: the writers each
    record goes to, the progress bar, the watchdog (each step over the
    interval its record times, dispatch and wait, less what `after_step`
    spends), throughput and MFU in each record, and the tracer's window.
    """
    start = int(local(state.step))
    eval_fn = evaluation.loss if evaluation is not None else None
    eval_every = evaluation.every if evaluation is not None else 0
    log = StepLog(start, steps, observers, max_consecutive_skips, eval_fn)
    tracer = observers.tracer
    pending: tuple[int, dict[str, jax.Array]] | None = None
    try:
        for step in range(start, steps):
            if tracer is not None and tracer.at_edge(step):
                # Nothing in flight at either edge: the trace holds its steps only.
                _drain(log, pending)
                pending = None
                log.pause()  # starting or writing the trace is not a step: unwatched
                tracer.toggle()
                log.restart_clock(step)  # writing the trace is not step time
            state, metrics = train_step(state, batch_at(step))
            _drain(log, pending)
            pending = (step, metrics)
            if eval_fn is not None and _evaluates(step + 1, steps, eval_every):
                log.finish(step, metrics, state.model_params)  # the state this step produced
                pending = None
            if after_step is not None:
                # A checkpoint save is bounded by its own timeouts: unwatched, and
                # the step in flight is watched from its end, so a long save (a
                # loaded host) is not a stuck step.
                log.pause()
                if after_step(step + 1, state):
                    break
                if pending is not None:
                    log.resume(step)
                else:
                    log.watch(step + 1)
        _drain(log, pending)
    finally:
        if tracer is not None:
            tracer.stop()
        log.close()
    return state, log.history


def _drain(log: StepLog, pending: tuple[int, dict[str, jax.Array]] | None) -> None:
    """Finish the step in flight, if there is one."""
    if pending is not None:
        log.finish(*pending)


def _evaluates(n: int, steps: int, every: int) -> bool:
    """Whether the state after n steps is evaluated: every `every` steps and at the end."""
    return n == steps or (every > 0 and n % every == 0)
