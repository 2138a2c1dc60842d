"""A training run end to end: where the state comes from, when it is saved,
and how the run stops. `zero-jax train` (cli/train.py) is the command line over this.

The state comes from, in order: `--resume` (the newest complete checkpoint
that verifies, falling back past corrupt ones), `--init-from` (parameters
only, with a fresh optimizer; under LoRA, the frozen base's), or a fresh
initialisation. It is saved every `--checkpoint-every` steps, at the end, at
`--stop-at`, and when the run is preempted (SIGTERM) or interrupted
(Ctrl-C), then exits cleanly (runtime/preempt.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Callable

import jax
from tqdm import tqdm

from zero_jax.checkpoint import manager as manager_lib
from zero_jax.data import corpus as corpus_lib
from zero_jax import loop
from zero_jax.runtime import distributed, preempt, trace, wandb_log
from zero_jax.analysis import flops
from zero_jax.runtime.metrics import MetricsWriter, TensorBoardWriter, Writers
from zero_jax.data import sampler
from zero_jax.job import Job
from zero_jax.checkpoint import weights
from zero_jax.checkpoint.weights import InitFromError, ParamLoader, load_params, place  # noqa: F401 (callers' names)
from zero_jax.train.state import TrainState
from zero_jax.runtime.watchdog import StepWatchdog
from zero_jax.sharding.specs import is_spec, named_leaves

@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    """A job's compiled steps: what its run calls."""

    train: Callable  # (state, batch) -> (state, metrics), the state donated
    eval: Callable  # (params, batch) -> the batch's mean loss over its targets


@dataclasses.dataclass(frozen=True)
class Reporting:
    """What a run tells beside its records, and where."""

    progress: bool = True  # a progress bar (on the first process only)
    log: Callable[[str], None] = print  # the run's lines: where it resumed, what it saved
    throughput: flops.Throughput | None = None  # FLOP/s per device and MFU in each record
    plan: dict[str, Any] | None = None  # summary.tables, logged to W&B with the run


@dataclasses.dataclass
class Outcome:
    state: TrainState
    history: list[dict[str, Any]]
    stopped: str = ""  # "preempted", "interrupted", "stop_at", or "" when all steps ran
    resumed_from: int | None = None
    line: str = ""  # an interrupted run's last line: where it stopped, which step restores


def checkpoint_meta(job: Job, step: int, corpus: corpus_lib.TokenData | None = None
                    ) -> dict[str, Any]:
    """What a checkpoint records beside the arrays (with `corpus`, what the
    data was: its token counts and tokenizer)."""
    run, t = job.run, job.run.train
    return {
        "run": run.to_dict(),
        "model": {"name": run.model.name,
                  **(dataclasses.asdict(job.model.config) if job.model.config else {})},
        "logical_axes": {path: list(spec) for path, spec in
                         named_leaves(job.state_plan.names, is_leaf=is_spec).items()},
        "data": data_meta(job, step, corpus),
        # No other randomness than the seed (initialisation, data order).
        "prng": {"seed": t.seed, "impl": str(jax.config.jax_default_prng_impl)},
        # The resolved policy ("auto" depends on the platform): a resume under
        # another one says so.
        "precision": dataclasses.asdict(job.policy),
        "layout": {"mesh": job.state_plan.mesh_shape.sizes, "zero_stage": job.state_plan.zero_stage,
                   "rules": job.state_plan.rules.name, "processes": jax.process_count()},
        "versions": {"jax": jax.__version__},
    }


def data_meta(job: Job, step: int, corpus: corpus_lib.TokenData | None) -> dict[str, Any]:
    """Where the data stands: batches are a pure function of (seed, split,
    step) in sampler.ORDER, so the position is the step."""
    run, t = job.run, job.run.train
    return {"source": run.data.source, "seed": t.seed, "next_step": step,
            "batch_size": t.batch_size, "seq_len": run.data.seq_len, "order": sampler.ORDER,
            **({"tokens": {s: corpus.tokens(s) for s in ("train", "val")},
                "tokenizer": corpus.meta.get("tokenizer", {})} if corpus else {})}


def _init_from_label(source: str) -> str:
    """--init-from as the run says it: a checkpoint directory with the step
    load_params reads (its newest complete one), else the path."""
    path = Path(source)
    steps = manager_lib.complete_steps(path) if path.is_dir() else []
    return f"{path / str(steps[-1])} (step {steps[-1]}, the newest complete)" if steps else source


def start_line(job: Job) -> str:
    """Where the state will come from, said before anything compiles: the
    first line a run prints, so that a --resume that finds nothing (a
    mistyped --checkpoint-dir, say) is read before the plan, not under it."""
    c = job.run.checkpoint
    fresh = (f"parameters from {_init_from_label(c.init_from)}; new optimizer state, step 0"
             if c.init_from else f"new parameters (seed {job.run.train.seed}), step 0")
    if not c.resume:
        return f"start: {fresh}"
    directory = Path(c.dir).absolute()
    steps = manager_lib.complete_steps(directory)
    if steps:
        return (f"start: --resume from {directory / str(steps[-1])} (step {steps[-1]}, the newest "
                "complete; each array checked by checksum, a corrupt checkpoint falls back to "
                "the one before)")
    # The config check has made the directory by now (paths.check): a mistyped
    # one reads as empty.
    empty = " (empty)" if not directory.exists() or not any(directory.iterdir()) else ""
    return f"start: --resume found no complete checkpoint in {directory}{empty}; {fresh}"


def initial_state(job: Job, checkpointer: manager_lib.Checkpointer | None,
                  loaders: list[ParamLoader], log: Callable[[str], None],
                  corpus: corpus_lib.TokenData | None = None
                  ) -> tuple[TrainState, int | None, str | None]:
    """(the state, the step it resumed from or None, under LoRA the base's digest)."""
    c = job.run.checkpoint
    frozen, base_digest = weights.base(job, loaders)  # under LoRA: checkpoints do not hold it
    if c.resume:
        restored = checkpointer.restore_latest(job.state_plan.targets, log)
        if restored is not None:
            saved, meta = restored
            step = int(distributed.local(saved.step))
            if frozen is not None:
                weights.check_base(meta, base_digest, job, checkpointer.directory / str(step))
            state = job.state_plan.from_saved(saved, frozen)
            arrays = sum(len(leaves) for leaves in meta["manifest"].values())
            log(f"resumed from {checkpointer.directory / str(step)} (step {step}; {arrays} arrays "
                "equal to the saved ones by checksum)")
            _log_config_changes(meta.get("run", {}), job.run.to_dict(), log)
            _log_precision_change(meta.get("precision"), job, log)
            if corpus is not None:
                _log_data_change(meta.get("data", {}), data_meta(job, step, corpus), log)
            return state, step, base_digest
        if checkpointer.complete_steps():  # else start_line has said there were none
            log(f"--resume: no checkpoint in {checkpointer.directory} verified; starting at step 0")
    if frozen is not None:  # adapters on it: fresh, or --lora-init-from's
        state = job.init_state(base=frozen)
        if job.run.lora.init_from:
            state = state._replace(params=weights.adapters(job, loaders))
        return state, None, base_digest
    if c.init_from:
        try:
            params = load_params(c.init_from, job, loaders)
        except (ValueError, FileNotFoundError) as e:
            raise InitFromError(f"--init-from {c.init_from}: {e}") from None
        return job.state_from_params(params), None, None
    return job.init_state(), None, None


def _log_precision_change(saved: dict | None, job: Job, log) -> None:
    """One explicit line when a run resumes under another precision policy."""
    now = dataclasses.asdict(job.policy)
    if saved is None or saved == now:
        return
    working = (f"the working copy is cast from them to {job.policy.compute}" if job.state_plan.master
               else f"the parameters are cast to {job.policy.compute} at use")
    log(f"precision changed: saved with {_listed(saved)}; resuming with {_listed(now)}. The "
        f"master weights ({saved.get('params')}) and optimizer state are restored as saved; "
        f"{working}")


def _listed(fields: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in fields.items())


def _log_data_change(saved: dict, now: dict, log) -> None:
    """One line per way the data differs from the saved run's: the batches
    from here on are then not those the saved run would have read."""
    for key in ("order", "tokens", "tokenizer"):
        if key in saved and saved[key] != now.get(key):
            log(f"  data.{key}: {saved[key]!r} at save, {now.get(key)!r} now: the batches from "
                "here on differ from those the saved run would have read")


def _log_config_changes(saved: dict, now: dict, log) -> None:
    for section in sorted(set(saved) | set(now)):
        for key in sorted(set(saved.get(section, {})) | set(now.get(section, {}))):
            old, new = saved.get(section, {}).get(key), now.get(section, {}).get(key)
            if old != new and section != "checkpoint":
                log(f"  {section}.{key}: {old!r} at save, {new!r} now")


class StopAndSave:
    """Called after each step (loop.train's `after_step`): notices preemption
    and --stop-at, saves when the run stops, at its last step and every
    --checkpoint-every steps, and says whether to stop."""

    def __init__(self, job: Job, corpus: corpus_lib.TokenData,
                 checkpointer: manager_lib.Checkpointer | None, meta: dict[str, Any] | None = None):
        self.job, self.corpus, self.checkpointer = job, corpus, checkpointer
        self.meta = meta or {}  # more for each checkpoint's meta (the W&B group, LoRA's base)
        self.preemption = preempt.Preemption()
        self.stopped = ""  # "preempted", "interrupted", "stop_at", or "" while running

    def __call__(self, n: int, state: TrainState) -> bool:
        t = self.job.run.train
        self.stopped = self.preemption.reason(n) or ("stop_at" if n == t.stop_at else "")
        if self.checkpointer is not None:
            if self.stopped or n == (t.stop_at or t.steps) or self.checkpointer.due(n):
                self.checkpointer.save(n, self.job.state_plan.saved_form(state),
                                       {**checkpoint_meta(self.job, n, self.corpus), **self.meta})
            self.checkpointer.check()
        # A stop asked for while this step was being saved: that save is the last.
        self.stopped = self.stopped or self.preemption.now()
        return bool(self.stopped)


def batches(job: Job, corpus: corpus_lib.TokenData, split: str) -> Callable[[int], Any]:
    """`step -> the global batch of `split` at that step`, in the job's batch sharding."""
    run, t = job.run, job.run.train
    return functools.partial(corpus_lib.global_batch, corpus, split, run.data.seq_len,
                             t.batch_size, t.seed, sharding=job.state_plan.batch_sharding,
                             segments=run.data.segment_ids)


def validation(job: Job, corpus: corpus_lib.TokenData, eval_step) -> Callable[[Any], float]:
    """`params -> validation loss` over --eval-batches batches."""
    t = job.run.train
    targets = functools.partial(corpus_lib.targets, corpus, "val", job.run.data.seq_len,
                                t.batch_size, t.seed)
    val_batch = batches(job, corpus, "val")

    def loss(params) -> float:
        return loop.evaluate(eval_step, params, val_batch, t.eval_batches, targets)

    return loss


def tracer(t, lead: bool) -> trace.Tracer:
    """The --profile-steps tracer of this process. Every process traces its
    own devices, each in its own directory (the profiler names its files
    after the host, which processes may share); only the first says so,
    above the progress bar."""
    directory = t.profile_dir or t.tensorboard_dir or "profile"
    if jax.process_count() > 1:
        directory = str(Path(directory) / f"process-{jax.process_index()}")
    return trace.Tracer(trace.Window.parse(t.profile_steps), directory,
                        tqdm.write if lead else lambda line: None)


def wandb_group(checkpointer: manager_lib.Checkpointer | None, resumed: int | None) -> str:
    """This job's W&B group: the one its checkpoint was saved under, when it
    resumes from one; else $WANDB_RUN_GROUP (wandb's own variable), else a
    new one (wandb_log: a run per invocation)."""
    saved = checkpointer.meta(resumed).get("wandb", {}) if resumed is not None else {}
    return saved.get("group") or os.environ.get("WANDB_RUN_GROUP") or wandb_log.new_group()


def writers(job: Job, start: int, group: str, lead: bool,
            plan: dict[str, Any] | None = None) -> Writers:
    """Where the records of a run starting at step `start` go: the metrics
    file, TensorBoard and W&B, from the first process only (one of each per
    run); `plan` (summary.tables) goes to W&B."""
    t = job.run.train
    if not lead:
        return Writers()
    return Writers(MetricsWriter(t.metrics_out, start), TensorBoardWriter(t.tensorboard_dir, start),
                   wandb_log.WandbWriter(t.wandb_project, t.wandb_mode, config=job.run.to_dict(),
                                         group=group, start=start, tables=plan))


def interrupted_line(prefix: str, directory: Path | None, abandoned: bool = False) -> str:
    """An interrupted run's one line: `prefix`, with `abandoned` the saves
    left uncommitted in `directory` (the checkpoint directory; None: there is
    none), and the step a --resume restores."""
    if directory is None:
        return f"{prefix}; nothing was saved (no --checkpoint-dir)"
    left = sorted({name.split(".")[0] for name in manager_lib.incomplete(directory)}, key=int)
    dropped = (f", abandoning the save of step {', '.join(left)} (it never commits)"
               if abandoned and left else "")
    steps = manager_lib.complete_steps(directory)
    if not steps:
        return f"{prefix}{dropped}; no checkpoint in {directory} has committed: nothing to resume from"
    return (f"{prefix}{dropped}; step {steps[-1]} is restorable from {directory / str(steps[-1])} "
            "(--resume continues from it)")


def train(job: Job, corpus: corpus_lib.TokenData, steps: CompiledSteps, *,
          loaders: list[ParamLoader] = (), reporting: Reporting = Reporting()) -> Outcome:
    """The run of `job` on `corpus` with its compiled steps, from its initial
    state (`initial_state`) to its last step, stop, preemption or Ctrl-C.
    `reporting` says what the run tells, and where (the plan to W&B)."""
    c, d = job.run.checkpoint, job.run.distributed
    # Save lines go above the progress bar, not through it.
    checkpointer = (manager_lib.Checkpointer(c, job.state_plan.names, writer=True, log=tqdm.write,
                                          barrier_timeout_s=d.barrier_timeout_s) if c.dir else None)
    directory = checkpointer.directory if checkpointer is not None else None
    # Ctrl-C stops after the step in flight; a second one at once, saying
    # which step is restorable (runtime/preempt.py).
    with preempt.interrupts(lambda: interrupted_line("interrupted again: stopped at once",
                                                     directory, abandoned=True)):
        state, resumed, base_digest = initial_state(job, checkpointer, loaders, reporting.log,
                                                    corpus)
        if jax.process_count() == 1 and preempt.interrupted():
            return Outcome(state, [], "interrupted", resumed,
                           interrupted_line("interrupted before training began", directory))
        # Every process has its state before any starts stepping; bounded, so a
        # process that died while restoring ends the run instead of holding it.
        distributed.barrier("state ready", d.barrier_timeout_s)
        return _train(job, corpus, steps, checkpointer, state, (resumed, base_digest), reporting)


def _train(job: Job, corpus: corpus_lib.TokenData, steps: CompiledSteps,
           checkpointer: manager_lib.Checkpointer | None, state: TrainState,
           start: tuple[int | None, str | None], reporting: Reporting) -> Outcome:
    """`train` from its initial state on; `start`: the step it resumed from
    (None: fresh), and under LoRA the base's digest (weights.base)."""
    resumed, base_digest = start
    run, t, d = job.run, job.run.train, job.run.distributed
    lead = jax.process_index() == 0  # one metrics file, W&B run and progress bar per run
    group = wandb_group(checkpointer, resumed) if t.wandb_project and lead else ""
    out = writers(job, resumed or 0, group, lead, reporting.plan)
    if checkpointer is not None:
        checkpointer.on_commit = out.committed  # the writers exist once the start step is known
    meta = {"wandb": {"group": group}} if group else {}
    if checkpointer is not None:  # under LoRA, the base the adapters are trained on
        meta.update(weights.base_meta(job, base_digest))
    after_step = StopAndSave(job, corpus, checkpointer, meta)
    watchdog = StepWatchdog(d.watchdog_warn, d.watchdog_stop, d.watchdog_min_s,
                            who=f"process {jax.process_index()}: " if jax.process_count() > 1 else "")
    try:
        observers = loop.Observers(writers=out, progress=reporting.progress and lead,
                                   watchdog=watchdog, throughput=reporting.throughput,
                                   tracer=tracer(t, lead))
        state, history = loop.train(
            state, steps.train, batches(job, corpus, "train"), steps=t.steps,
            evaluation=loop.Evaluation(validation(job, corpus, steps.eval), t.eval_every),
            after_step=after_step, max_consecutive_skips=run.precision.max_consecutive_skips,
            observers=observers)
        if checkpointer is not None:
            checkpointer.wait()
    except manager_lib.SaveFailed:
        if checkpointer is not None:
            for name in checkpointer.remove_incomplete():
                reporting.log(f"removed the uncommitted {checkpointer.directory / name}")
        raise
    finally:
        watchdog.close()
    if reporting.throughput is not None:
        reporting.throughput.check_peak(history)
    # A Ctrl-C while the last save committed: the run ended, and says so.
    stopped = after_step.stopped or after_step.preemption.now()
    step = int(distributed.local(state.step))
    if stopped == "interrupted":
        directory = checkpointer.directory if checkpointer is not None else None
        return Outcome(state, history, stopped, resumed,
                       interrupted_line(f"interrupted: stopped after step {step}", directory))
    if stopped and checkpointer is not None:
        reporting.log(f"{stopped}: saved step {step} in {checkpointer.directory}")
    return Outcome(state, history, stopped, resumed)
