"""What a killed and resumed run records: its metrics file, TensorBoard
events and Weights & Biases runs (--wandb-mode offline, read back with
wandb's own reader of the .wandb file, `wandb leet inspect --json`), each
against the metrics file of the same run. One job trains twice: killed
(SIGKILL) after a checkpoint has committed, then resumed; each invocation
is a W&B run of the job's group. The first also profiles two steps."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import recorded_steps
from zero_jax.cli import train as train_cli

ROOT = Path(__file__).resolve().parent.parent
STEPS = 12
FLAGS = ["--devices", "2", "--mesh", "fsdp=2", "--seq-len", "32", "--batch-size", "8",
         "--steps", str(STEPS), "--eval-every", "0", "--eval-batches", "1", "--no-progress",
         "--checkpoint-dir", "ckpt", "--checkpoint-every", "4", "--metrics-out", "m.jsonl",
         "--tensorboard-dir", "tb", "--wandb-project", "zero-jax-test", "--wandb-mode", "offline"]


def _start(tmp: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "ZERO_JAX_CACHE": str(tmp / "cache"), "WANDB_DIR": str(tmp),
           "WANDB_SILENT": "true"}
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *FLAGS, *flags],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _kill_after_a_commit(tmp: Path) -> int:
    """Train with synchronous saves until the first checkpoint has
    committed (its "saved" line) and the metrics file holds the record
    after it: W&B's writer flushed at the commit, once it had logged the
    checkpoint's step, before that record was written. Then SIGKILL it, a
    step later, well inside the second wandb takes to write its file by
    itself. Returns the checkpoint's step."""
    proc, lines = _start(tmp, "--no-async-save", "--profile-steps", "2:4"), []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        saved = [int(line.split()[2]) for line in list(lines) if line.startswith("checkpoint step ")]
        if saved and max(recorded_steps(tmp / "m.jsonl"), default=0) > saved[0]:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    assert max(recorded_steps(tmp / "m.jsonl")) < STEPS, "the run ended before it was killed"
    return saved[0]


def _read_run(run_dir: Path) -> dict:
    """The records of an offline run's .wandb file, read by wandb itself."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert records, out.stderr
    run = next(r["run"] for r in records if r["type"] == "run")
    history = {r["history"]["step"]["num"]: r["history"]["item"]
               for r in records if r["type"] == "history"}
    return {"run": run, "history": history, "dir": run_dir}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    pytest.importorskip("wandb")  # the test extra has it; the last two tests need it not
    tmp = tmp_path_factory.mktemp("wandb")
    committed = _kill_after_a_commit(tmp)
    first_records = {r["step"]: r for r in map(json.loads, (tmp / "m.jsonl").read_text()
                                               .splitlines()) if "loss" in r}
    second = _start(tmp, "--resume")
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0, out
    start = int(out.split("resumed from ")[1].split("(step ")[1].split(";")[0])
    assert "MFU" in out.splitlines()[-1], out
    runs = sorted((tmp / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs  # one W&B run per invocation
    return {"committed": committed, "start": start, "first_records": first_records, "tmp": tmp,
            "records": [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()],
            "killed": _read_run(runs[0]), "resumed": _read_run(runs[1])}


def test_the_resumed_run_logs_every_step_it_trains_once(job):
    """Acceptance: the run's history holds train/loss and perf/mfu for
    every step it trained, equal to the metrics file's records."""
    history, start = job["resumed"]["history"], job["start"]
    assert sorted(history) == list(range(start + 1, STEPS + 1))
    records = {r["step"]: r for r in job["records"]}
    assert sorted(records) == list(range(1, STEPS + 1))
    for step, item in history.items():
        assert item["train/loss"] == records[step]["loss"]
        assert item["perf/mfu"] == records[step]["mfu"] > 0
        assert item["train/lr"] == records[step]["lr"]
    assert history[STEPS]["val/loss"] == records[STEPS]["val_loss"]


def test_a_killed_run_keeps_every_step_up_to_the_checkpoint_it_saw_commit(job):
    """The writers flush when a checkpoint commits: after SIGKILL, the
    killed run's file holds every step up to that checkpoint, with the
    values the metrics file had (wandb by itself writes its file every
    FLUSH_INTERVAL_S, in 15 s by default: the last steps would be lost)."""
    history, committed = job["killed"]["history"], job["committed"]
    assert committed >= 4 and set(range(1, committed + 1)) <= set(history)
    for step in range(1, committed + 1):
        assert history[step]["train/loss"] == job["first_records"][step]["loss"]
        assert history[step]["perf/mfu"] == job["first_records"][step]["mfu"]
    assert job["start"] == committed  # killed before the next save


def test_both_runs_are_one_group_named_after_where_they_start(job):
    killed, resumed = job["killed"]["run"], job["resumed"]["run"]
    assert killed["run_group"] == resumed["run_group"] != ""
    assert killed["display_name"] == killed["run_group"]
    assert resumed["display_name"] == f"{killed['run_group']} from step {job['start']}"
    assert killed["run_id"] != resumed["run_id"]


def test_each_step_is_recorded_once_in_the_metrics_and_tensorboard(job):
    """Steps after the checkpoint, trained again by the resumed run, are cut
    from the metrics file and purged from the TensorBoard events: each step
    is recorded once in both, every record with its MFU. The killed run's
    profile of steps 2-3 was written before the kill."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = job["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert max(job["first_records"]) > job["start"]  # some steps were trained twice
    assert all(r["mfu"] > 0 and r["model_tflops_per_device"] > 0 for r in records)
    events = EventAccumulator(str(job["tmp"] / "tb"))
    events.Reload()
    assert {"train/loss", "val/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s",
            "perf/mfu", "train/loss_scale", "train/skipped",
            "memory/host_resident_bytes"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [r["loss"] for r in records])
    traces = list(job["tmp"].glob("tb/plugins/profile/*/perfetto_trace.json.gz"))
    assert traces and json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]


@pytest.mark.parametrize("which,flags", [("killed", ["--no-async-save", "--profile-steps", "2:4"]),
                                         ("resumed", ["--resume"])])
def test_the_config_is_the_run_config(job, which, flags):
    cfg, _ = train_cli.parse([*FLAGS, *flags])
    logged = {k: v for k, v in job[which]["run"]["config"]["update"].items() if k != "_wandb"}
    assert logged == json.loads(json.dumps(cfg.to_dict()))
    assert logged["train"]["wandb_mode"] == "offline"


def test_the_plan_is_logged_as_tables_with_the_first_step(job):
    """The printed plan's rows as data: one row per summary line, per
    parameter, per memory figure, under real columns."""
    run = job["resumed"]
    first = run["history"][job["start"] + 1]
    tables = {}
    for name in ("plan/summary", "plan/state_layout", "plan/memory_mib"):
        assert first[f"{name}._type"] == "table-file"
        tables[name] = json.loads((run["dir"] / "files" / first[f"{name}.path"]).read_text())
    summary = dict(tables["plan/summary"]["data"])
    assert tables["plan/summary"]["columns"] == ["item", "value"]
    assert "2 devices" in summary["mesh"] and "fsdp=2" in summary["mesh"]
    assert summary["zero"].startswith("stage 3 over fsdp")
    state_plan = tables["plan/state_layout"]
    assert state_plan["columns"] == ["parameter", "stored", "gradient", "optimizer state"]
    assert len(state_plan["data"]) > 4 and all(len(row) == 4 for row in state_plan["data"])
    assert any("/fsdp" in row[1] for row in state_plan["data"])  # ZeRO-3 stores shards
    memory = tables["plan/memory_mib"]
    assert memory["columns"] == ["figure", "params", "grads", "opt_state", "total"]
    assert [row[0] for row in memory["data"]][:2] == ["ZeRO formula", "actual shardings"]
    assert all(row[4] == pytest.approx(sum(row[1:4])) for row in memory["data"])
    assert not any(k.startswith("plan/") for k in run["history"][job["start"] + 2])


def test_without_wandb_the_flag_is_one_line_and_exit_2_before_compiling(tmp_path):
    """wandb's import blocked the standard way (None in sys.modules), not
    imitated: the run stops on the config check, before any compile."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.modules['wandb'] = None\n"
            "from zero_jax.cli import train\n"
            f"sys.exit(train.main({FLAGS!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "ZERO_JAX_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'zero-jax[wandb]'" in lines[0], out.stderr
    assert "plan" not in out.stdout and not (tmp_path / "wandb").exists()


def test_wandb_mode_takes_online_or_offline_only():
    from zero_jax import config as config_lib

    with pytest.raises(config_lib.ConfigError, match="--wandb-mode 'sometimes': choose from "
                                                     "online, offline"):
        config_lib.build(None, {"train.wandb_mode": "sometimes"})


@pytest.mark.parametrize("toml,flags,project", [
    ('[train]\nwandb_project = "p"\n', ["--wandb-mode", "offline"], "p"),
    ('[train]\nwandb_mode = "offline"\n', ["--wandb-project", "q"], "q"),
    ('[train]\nwandb_mode = "offline"\n', ["--wandb-project", ""], ""),  # W&B turned off
])
def test_a_wandb_mode_is_taken_where_a_project_is_named(tmp_path, toml, flags, project):
    """A mode with a project from the config or the flags is the run's; a
    project emptied on the command line turns W&B off, mode and all. (A mode
    with no project at all is refused: tests/test_bad_inputs.py.)"""
    (tmp_path / "run.toml").write_text(toml)
    cfg, _ = train_cli.parse(["--config", str(tmp_path / "run.toml"), *flags])
    assert (cfg.train.wandb_project, cfg.train.wandb_mode) == (project, "offline")
