"""The command-line entry points, run as a user runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_train_prints_plan_and_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    config = tmp_path / "run.toml"
    config.write_text('[parallel]\nmesh = "data=2,fsdp=4"\nzero_stage = 2\n'
                      "[train]\nsteps = 99\nbatch_size = 16\neval_every = 3\neval_batches = 2\n"
                      "[data]\nseq_len = 32\n")
    ckpt = tmp_path / "ckpt"  # not there yet: --resume says so first, and starts at step 0
    p = run("scripts/train.py", "--config", str(config), "--steps", "6", "--metrics-out",
            str(metrics), "--checkpoint-dir", str(ckpt), "--resume")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == (f"start: --resume found no complete checkpoint in {ckpt} "
                                        "(empty); new parameters (seed 0), step 0")
    assert "== zero_jax plan ==" in p.stdout
    assert "stage 2 over data*fsdp (N_d=8)" in p.stdout
    assert "global 16 = 2 per device x 1 microbatches x 8 data-parallel" in p.stdout
    assert "compiled step, measured: arguments" in p.stdout
    assert "step/s" in p.stdout or "s/step" in p.stdout  # the progress bar
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"} <= set(r)
    assert "val_loss" in records[2] and "val_loss" in records[5]


def test_train_rejects_bad_input_before_compiling():
    p = run("scripts/train.py", "--batch-size", "12", "--steps", "1")
    assert p.returncode == 2
    assert "error: --batch-size 12 is not divisible by the data-parallel size 8" in p.stderr
    assert "zero_jax plan" not in p.stdout


def test_memory_report_json():
    p = run("scripts/memory_report.py", "--model", "gpt-tiny", "--mesh", "fsdp=8",
            "--zero-stage", "3", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert set(report) == {"param_count", "bytes_per_param", "formula", "theory_bytes",
                           "sharded_bytes", "compiled", "activations", "collectives",
                           "collective_bytes", "collective_theory", "collective_notes",
                           "device_bytes", "host_bytes"}
    assert report["collective_bytes"] == sum(report["collectives"].values()) > 0
    assert set(report["collective_theory"]) == {"gradients", "parameters", "total"}
    assert set(report["activations"]) == {"analytic_bytes", "compiled_temp_bytes"}
    for key in ("theory_bytes", "sharded_bytes", "device_bytes", "host_bytes"):
        assert set(report[key]) == {"params", "grads", "opt_state"}
    assert report["device_bytes"] == report["sharded_bytes"]  # nothing offloaded
    assert sum(report["host_bytes"].values()) == 0
    assert {"argument_bytes", "output_bytes", "temp_bytes"} <= set(report["compiled"])


def test_memory_report_simulates_the_devices_a_mesh_needs():
    p = run("scripts/memory_report.py", "--model", "gpt-small", "--mesh", "gpu-4x8",
            "--vocab-size", "50257", "--no-compile", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    # Hybrid: Adam's 8 bytes per parameter split 8 ways (fsdp), not 32; plus two
    # int32 step counts (Adam's and the learning-rate schedule's).
    psi = report["param_count"]
    assert report["theory_bytes"]["opt_state"] == 8 * psi / 8 + 8
    assert report["sharded_bytes"]["opt_state"] == pytest.approx(
        report["theory_bytes"]["opt_state"], rel=0.01)


def test_parallel_precision_and_remat_options_reach_the_plan(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[parallel]\nmesh = "fsdp=4,tensor=2"\nlayout = "fsdp_tp_sp"\n'
                      '[precision]\npolicy = "bf16"\n[activations]\nremat = "save_names"\n'
                      'save_names = "qkv,mlp_hidden"\n[model]\nvocab_multiple = 64\n'
                      "[train]\nsteps = 2\nbatch_size = 16\neval_batches = 1\n[data]\nseq_len = 32\n")
    p = run("scripts/train.py", "--config", str(config), "--remat", "dots_saveable",
            "--no-progress")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "vocab 256" in out and "tensor=2" in out
    assert "layout     fsdp_tp_sp: tensor splits heads, mlp, vocab; sequence split over tensor" in out
    assert "precision  parameters float32, compute bfloat16, gradients float32" in out
    assert "states     params 4/4 + grads 4/4 + optimizer state 8/4 = 4 bytes per parameter, " \
        "/ tensor 2 = 2" in out
    assert "MiB of payload per device per step" in out and "ZeRO volumes" in out
    assert "remat      dots_saveable" in out  # the flag overrides the file
    assert "activations, one microbatch:" in out


def test_memory_report_remat_table():
    p = run("scripts/memory_report.py", "--model", "gpt-tiny", "--seq-len", "64",
            "--batch-size", "16", "--remat-table", "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert set(rows) == {"none", "full", "dots_saveable", "save_names", "offload"}
    assert rows["full"]["compiled_temp_bytes"] < rows["none"]["compiled_temp_bytes"]


def test_pipelined_training_runs_and_prints_its_stages(tmp_path):
    """The pipeline command of the README, shortened: 3D with 1f1b. (Its
    numbers against one device: test_pipeline.py and test_numerics.py.)"""
    out = tmp_path / "piped.jsonl"
    p = run("scripts/train.py", "--mesh", "pipe=2,fsdp=2,tensor=2", "--pipeline-schedule", "1f1b",
            "--steps", "8", "--seq-len", "32", "--microbatches", "8", "--eval-every", "0",
            "--eval-batches", "1", "--no-progress", "--metrics-out", str(out), "--plan", "full")
    assert p.returncode == 0, p.stderr
    assert "pipeline   1f1b: p=2 stages, m=8 microbatches, v=1" in p.stdout
    assert "stage 0: layers 0-1 (2 of 4)\n" in p.stdout
    assert "stage 1: layers 2-3 (2 of 4)\n" in p.stdout
    assert "on the row block it stores of the tables whose rows are pos, vocab" in p.stdout
    losses = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0]
