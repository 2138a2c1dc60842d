"""Where per-step metrics go: the JSON-lines file (always on), TensorBoard
(`--tensorboard-dir`), and the memory figures added to each record.

Both writers take the step a run resumes at and drop what was written after
it (records of steps the resumed run trains again), so each step appears
once in either. Every writer (these two, and W&B's in wandb_log.py) has
`write(record)`, `committed(step)` and `close()`: `committed` is called
when a checkpoint of `step` commits, and returns once every record up to
that step is where a crash cannot take it, so a run resumed from that
checkpoint has lost nothing it does not train again.

`read_records` reads a JSON-lines file back, for plots of it: its records,
the tokens seen by each step, and one key's finite values.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax

class MetricsWriter:
    """One JSON object per line; flushed so a crashed run keeps its history.

    Strict JSON: a non-finite value is written as null and its key listed
    under "non_finite". A run resumed at step `start` first cuts the file
    back to the records of steps up to `start` (those after it, written
    before a crash, are trained again), so each step appears once.
    """

    def __init__(self, path: str, start: int = 0):
        self._file = None
        if not path:
            return
        kept = [line.rstrip("\n") + "\n" for line in _lines(path) if _step(line) <= start] \
            if start else []
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self._file = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        if self._file:
            bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
            out = {**record, **{k: None for k in bad}, **({"non_finite": bad} if bad else {})}
            self._file.write(json.dumps(out, allow_nan=False) + "\n")
            self._file.flush()

    def committed(self, step: int) -> None:
        """Every line is flushed as it is written: nothing waits (the flush
        is repeated so that the promise does not rest on `write` alone)."""
        if self._file:
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None  # a commit noticed after the loop has nothing to flush


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.readlines()
    except FileNotFoundError:
        return []


def _step(line: str) -> float:
    """A record's step; a line cut short by a crash sorts after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


# Record keys -> TensorBoard tags: grouped so the curves that belong together
# share a panel.
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "grad_norm": "train/grad_norm",
        "lr": "train/lr", "loss_scale": "train/loss_scale", "skipped": "train/skipped",
        "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s",
        "mfu": "perf/mfu", "hfu": "perf/hfu",
        "model_tflops_per_device": "perf/model_tflops_per_device",
        "hardware_tflops_per_device": "perf/hardware_tflops_per_device",
        "device_bytes_in_use": "memory/device_bytes_in_use",
        "device_peak_bytes": "memory/device_peak_bytes",
        "host_resident_bytes": "memory/host_resident_bytes",
        "aux_loss": "moe/aux_loss", "z_loss": "moe/z_loss",
        "expert_load_max": "moe/expert_load_max", "mtp_loss": "train/mtp_loss"}
# A mixture of experts' per-layer load (record "expert_load", a list): one tag per layer.
LOAD_TAG = "moe/expert_load_layer_{:02d}"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers under their tags (TAGS, LOAD_TAG); what is not a
    number (a missing key, a None written for a non-finite value) is left out."""
    pairs = [(tag, record.get(key)) for key, tag in TAGS.items()]
    pairs += [(LOAD_TAG.format(i), v) for i, v in enumerate(record.get("expert_load", ()))]
    return {tag: float(v) for tag, v in pairs if isinstance(v, (int, float))}


class TensorBoardWriter:
    """Scalars of each record in a TensorBoard event file (tensorboardX's
    event format).

    A run resumed at step `start` purges the events after it (a session
    start at `start + 1`, as tensorboardX's `purge_step` writes), as
    MetricsWriter cuts its file back. Events are written and flushed with
    each record, in this thread, as MetricsWriter's lines are: a run killed
    after a checkpoint keeps every step up to it, which its resumed run does
    not write again. (tensorboardX's SummaryWriter queues events for a
    writer thread, and its flush does not wait for the queue.)
    """

    def __init__(self, logdir: str, start: int = 0):
        self._events = None
        if not logdir:
            return
        # Imported here: only runs that ask need them.
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2
        from tensorboardX.summary import scalar

        os.makedirs(logdir, exist_ok=True)
        self._event, self._scalar = event_pb2.Event, scalar
        self._events = EventsWriter(os.path.join(logdir, "events"))
        if start:
            self._events.write_event(self._event(
                step=start + 1, wall_time=time.time(),
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
            self._events.flush()

    def write(self, record: dict[str, Any]) -> None:
        if self._events is None:
            return
        now = time.time()
        for tag, value in scalars(record).items():
            self._events.write_event(self._event(step=record["step"], wall_time=now,
                                                 summary=self._scalar(tag, value)))
        self._events.flush()

    def committed(self, step: int) -> None:
        """Events are flushed with each record: nothing waits (flushed again,
        as MetricsWriter's file is)."""
        if self._events is not None:
            self._events.flush()

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None


class Writers:
    """A run's writers as one: each record goes to every one of them, and so
    does a checkpoint's commit."""

    def __init__(self, *writers):
        self.writers = writers

    def write(self, record: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.write(record)

    def committed(self, step: int) -> None:
        for writer in self.writers:
            writer.committed(step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class RecordsError(ValueError):
    """A metrics file that cannot be read as a run's records."""


def read_records(path: Path) -> list[dict]:
    """The records of one metrics file. A last line cut short (a run that
    crashed while writing it) is dropped; a bad line elsewhere is an error."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise RecordsError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordsError(f"{path}: cannot read it ({e})") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break
            raise RecordsError(f"{path}:{number}: not a JSON object; is this a --metrics-out file?") from None
        if not isinstance(record, dict) or "step" not in record:
            raise RecordsError(f"{path}:{number}: a record without a 'step'; is this a --metrics-out file?")
        records.append(record)
    if not records:
        raise RecordsError(f"{path}: no records (an empty metrics file)")
    return records


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def tokens_seen(records: list[dict]) -> list[float]:
    """Tokens seen by the end of each record's step. The records hold no
    token count of their own: each step's tokens are its `tokens_per_s`
    times its `step_time_s` (zero_jax/loop.py divides the step's tokens by
    that same time), summed over the steps before it. A step whose rate or
    time is null counts the tokens of the last step that had both: a run's
    steps all see the same batch shape."""
    total, per_step, out = 0.0, 0.0, []
    for r in records:
        rate, seconds = r.get("tokens_per_s"), r.get("step_time_s")
        if finite(rate) and finite(seconds):
            per_step = rate * seconds
        total += per_step
        out.append(total)
    return out


def series(records: list[dict], tokens: list[float], key: str
           ) -> tuple[list[float], list[float], list[float]]:
    """(steps, tokens, values) of `key`, where the record has a finite value."""
    kept = [(r["step"], t, r[key]) for r, t in zip(records, tokens) if finite(r.get(key))]
    return tuple(map(list, zip(*kept))) if kept else ([], [], [])


def memory() -> dict[str, int]:
    """This process's memory now: the first local device's bytes in use and
    peak where the backend reports them (GPU, TPU), else (CPU) the process's
    resident bytes, which hold the CPU devices' buffers."""
    stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_in_use" in stats:
        return {"device_bytes_in_use": int(stats["bytes_in_use"]),
                "device_peak_bytes": int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))}
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return {"host_resident_bytes": kb * 1024}
    except (OSError, StopIteration):
        return {}
