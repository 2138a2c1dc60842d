"""Per-step metrics, the run config and the plan in a Weights & Biases run
(`--wandb-project`, `--wandb-mode`), through the `wandb` library (the
`wandb` extra: pip install 'zero-jax[wandb]').

The scalars are TensorBoard's: the same tags (metrics.scalars) at the
record's step. Each invocation is one W&B run, started by the first process
only. W&B's history steps only increase within a run, and a run resumed
from the checkpoint of step N trains steps N + 1 ... again, which the
interrupted invocation may have logged already: so a resumed invocation is
a new run in the same group (the group is kept in the checkpoint's meta),
named after the step it starts from, and logs steps N + 1 on; the
interrupted run keeps what it logged. Every step then appears once in each
run, online or offline and synced later.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from zero_jax.runtime.metrics import scalars

# wandb's service writes the run's .wandb file in blocks: when one fills,
# every x_transaction_log_flush_interval seconds (15 by default) and when
# the run finishes; wandb 0.31 has no call that writes it on demand. A
# checkpoint's commit waits for the next of these writes (`committed`), so
# a short interval keeps that wait short.
FLUSH_INTERVAL_S = 1.0


def new_group() -> str:
    """A job's W&B group: the runs of its first invocation and of every resume."""
    return uuid.uuid4().hex[:8]


def run_name(group: str, start: int) -> str:
    return group if not start else f"{group} from step {start}"


class WandbWriter:
    """One W&B run: `config` as its config, `tables` (summary.tables: name
    -> rows under columns) logged as wandb.Tables with the first record,
    each record's scalars at its step. A project of "" writes nothing."""

    def __init__(self, project: str, mode: str = "online", *, config: dict[str, Any] | None = None,
                 group: str = "", start: int = 0, tables: dict[str, Any] | None = None):
        self._run = None
        if not project:
            return
        import wandb  # only runs that ask need it (the `wandb` extra)

        fields = getattr(wandb.Settings, "model_fields", {})  # older wandb: no such setting
        settings = wandb.Settings(**({"x_transaction_log_flush_interval": FLUSH_INTERVAL_S}
                                     if "x_transaction_log_flush_interval" in fields else {}))
        group = group or new_group()
        self._run = wandb.init(project=project, mode=mode, config=config or {}, group=group,
                               name=run_name(group, start), settings=settings)
        self._pending = {name: wandb.Table(columns=list(t.columns), data=[list(r) for r in t.rows])
                         for name, t in (tables or {}).items()}
        self._last = start  # the last step logged
        self._due = 0  # a committed checkpoint's step not yet logged (0: none)

    def write(self, record: dict[str, Any]) -> None:
        if self._run is None:
            return
        data, self._pending = {**scalars(record), **self._pending}, {}
        self._run.log(data, step=record["step"], commit=True)
        self._last = record["step"]
        if self._due and self._last >= self._due:
            self._due = 0
            self._flush()

    def committed(self, step: int) -> None:
        """A checkpoint of `step` committed: its step goes into the run's
        summary, and once the record of `step` is logged (a synchronous save
        commits before it is), this waits until the run's file holds it."""
        if self._run is None:
            return
        self._run.summary["checkpoint/step"] = step
        if self._last >= step:
            self._flush()
        else:
            self._due = max(self._due, step)

    def _flush(self) -> None:
        """Wait until what was logged is in the run's .wandb file. Reading the
        summary waits for the service to have handled every record sent
        before it, the summary update last; its next timed write then
        writes them all (FLUSH_INTERVAL_S). Bounded: a service that does not
        write costs at most a few intervals."""
        dict(self._run.summary)
        asked = time.time()
        path = self._run.settings.sync_file
        if not _mtime(path):  # no .wandb file (x_skip_transaction_log, online only): no wait
            return
        deadline = asked + 3 * FLUSH_INTERVAL_S
        while _mtime(path) < asked and time.time() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        """Finish the run: wandb writes and closes its file."""
        if self._run is not None:
            self._run.finish()
            self._run = None  # a commit noticed after the loop finds it written


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
