"""Several processes on 127.0.0.1 through scripts/launch.py, on JAX's own
distributed runtime with gloo collectives: the same numbers as one process,
checkpoints across process counts, and faults that end in bounded time."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
SMALL = ["--seq-len", "32", "--batch-size", "16", "--eval-every", "0", "--eval-batches", "1",
         "--no-progress", "--zero-stage", "3"]


def launch(n, k, *args, timeout=300, background=False):
    """scripts/launch.py -n n --devices-per-process k -- scripts/train.py args."""
    cmd = [sys.executable, "scripts/launch.py", "-n", str(n), "--devices-per-process", str(k),
           "--", "scripts/train.py", *args]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def losses(path):
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process x 8 devices, ten steps."""
    out = tmp_path_factory.mktemp("ref") / "m.jsonl"
    p = subprocess.run([sys.executable, "scripts/train.py", "--steps", "10", "--mesh", "fsdp=8",
                        *SMALL, "--metrics-out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       env={**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return losses(out)


# Each process compiles the step on this machine's 2 cores, so a run costs
# about its process count: CI runs 2 processes, ZeRO-3 over all 8 devices,
# fsdp inside a process and data across (4 processes restore a checkpoint
# below); ZERO_JAX_FULL_GRID=1 adds 4 processes, and fsdp=8 across processes
# at both counts.
RUNS = [(2, 4, "cpu-2x4")] + (
    [(4, 2, "cpu-4x2"), (2, 4, "fsdp=8"), (4, 2, "fsdp=8")] if os.environ.get("ZERO_JAX_FULL_GRID")
    else [])


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """2 processes x 4 devices (cpu-2x4), ten steps, a checkpoint every 4:
    the first of RUNS, and the checkpoint the restore test resumes."""
    tmp = tmp_path_factory.mktemp("two")
    out, ckpt = tmp / "m.jsonl", tmp / "ckpt"
    p = launch(2, 4, "--steps", "10", "--mesh", "cpu-2x4", *SMALL, "--metrics-out", str(out),
               "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4")
    assert p.returncode == 0, p.stdout[-4000:]
    # The suite's persistent cache is in the environment: off for CPU processes (docs/hosts.md).
    assert "the persistent compilation cache is off" in p.stdout, p.stdout[:2000]
    return {"stdout": p.stdout, "losses": losses(out), "checkpoints": ckpt}


@pytest.mark.parametrize("n,k,mesh", RUNS, ids=[f"{n}x{k}-{m}" for n, k, m in RUNS])
def test_processes_give_the_losses_of_one_process(reference, two_processes, tmp_path, n, k, mesh):
    if (n, k, mesh) == RUNS[0]:
        stdout, run_losses = two_processes["stdout"], two_processes["losses"]
    else:
        out = tmp_path / "m.jsonl"
        p = launch(n, k, "--steps", "10", "--mesh", mesh, *SMALL, "--metrics-out", str(out))
        assert p.returncode == 0, p.stdout[-4000:]
        stdout, run_losses = p.stdout, losses(out)
    assert f"[{n - 1}] " in stdout  # every process's lines, prefixed
    if mesh.startswith("cpu-"):
        assert "data: across processes" in stdout and "fsdp: inside each process" in stdout
    np.testing.assert_allclose(run_losses, reference, rtol=1e-5)


def test_checkpoint_of_two_processes_restores_in_one_and_in_four(two_processes, tmp_path):
    """Saved by 2 processes at step 4, resumed by 4 (and, under
    ZERO_JAX_FULL_GRID=1, by 1): steps 5 and 6 as the 2 processes trained
    them. A restore verifies every array against the checksum saved with it
    (layout-independent, of the exact bits), so a restore that succeeds is
    bit-exact."""
    saved = two_processes["checkpoints"] / "4"
    assert saved.is_dir(), sorted(os.listdir(two_processes["checkpoints"]))
    for n, k in ((1, 8), (4, 2)) if os.environ.get("ZERO_JAX_FULL_GRID") else ((4, 2),):
        directory, out = tmp_path / f"resumed-by-{n}", tmp_path / f"{n}.jsonl"
        shutil.copytree(saved, directory / "4")
        p = launch(n, k, "--steps", "6", "--mesh", "fsdp=8", *SMALL, "--checkpoint-dir",
                   str(directory), "--resume", "--metrics-out", str(out))
        assert p.returncode == 0, p.stdout[-4000:]
        assert re.search(r"\(step 4; \d+ arrays equal to the saved ones by checksum\)", p.stdout)
        np.testing.assert_allclose(losses(out), two_processes["losses"][4:6], rtol=1e-5)


def _children(launcher_pid):
    """{process index: pid} of a launcher's processes (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid:
            for var in env:
                if var.startswith(b"ZERO_JAX_PROCESS_ID="):
                    found[int(var.split(b"=")[1])] = int(entry.name)
    return found


def _wait_for_steps(metrics, n, proc, limit=240):
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {limit} s")


def test_a_killed_process_ends_the_launch_within_30_s(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = launch(2, 4, "--steps", "100000", "--mesh", "fsdp=8", *SMALL, "--metrics-out",
                  str(metrics), background=True)
    try:
        _wait_for_steps(metrics, 2, proc)
        os.kill(_children(proc.pid)[1], signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"launcher exited {took:.1f} s after SIGKILL")
    assert proc.returncode != 0 and took < 30
    assert "launch: process 1 failed (killed by SIGKILL); killed processes [0]" in out


def test_sigterm_to_one_process_saves_everywhere_at_one_step_and_resumes(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = ["--mesh", "cpu-2x4", *SMALL, "--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics)]
    proc = launch(2, 4, "--steps", "100000", *args, background=True)
    try:
        _wait_for_steps(metrics, 2, proc)
        os.kill(_children(proc.pid)[1], signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    saved = {int(i): int(step) for i, step in re.findall(r"\[(\d)\] preempted: saved step (\d+)", out)}
    assert sorted(saved) == [0, 1] and len(set(saved.values())) == 1, out[-3000:]
    step = saved[0]
    assert os.listdir(ckpt) == [str(step)]
    p = launch(2, 4, "--steps", str(step + 2), "--resume", *args)
    assert p.returncode == 0, p.stdout[-4000:]
    assert f"resumed from {ckpt / str(step)} (step {step};" in p.stdout
    assert len(losses(metrics)) == step + 2


def test_different_configs_stop_at_start_up_naming_the_processes(tmp_path):
    """Process 1 pads the vocabulary differently: a different model."""
    cmd = [sys.executable, "scripts/launch.py", "-n", "2", "--devices-per-process", "4", "--",
           "sh", "-c", f'exec {sys.executable} scripts/train.py --steps 5 --mesh fsdp=8 '
           + " ".join(SMALL) + ' --vocab-multiple $((1 + 383 * ZERO_JAX_PROCESS_ID))']
    start = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - start
    assert p.returncode != 0
    assert "differs between processes" in p.stdout, p.stdout[-3000:]
    assert "processes [1]: model.vocab_multiple=384 (process 0: 1)" in p.stdout
    assert "train_step=" in p.stdout
    print(f"stopped after {took:.1f} s")
