"""What a run shows while it trains: FLOPs and MFU against the compiler's
count and the measured peak. (What a killed and resumed run records, in its
metrics, TensorBoard and W&B: test_wandb.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import pytest

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import cpu_peak, flops
from zero_jax.model.remat import Remat

FULL = os.environ.get("ZERO_JAX_FULL_GRID") == "1"

# (model, remat): CI compiles two unrolled programs, one per family and
# policy; the full grid every pair.
COST_CASES = [("gpt-small", "none"), ("llama-tiny", "full")]
if FULL:
    COST_CASES = [(m, r) for m in ("gpt-small", "llama-tiny")
                  for r in ("none", "full", "dots_saveable", "save_names")]


@pytest.mark.parametrize("model,remat", COST_CASES)
def test_flops_per_token_agree_with_the_compilers_count(model, remat):
    """The FLOPs MFU is computed from (model FLOPs, and with remat hardware
    FLOPs) against the compiled step's own count, divided by its tokens. The
    layer stack is unrolled for this: XLA's cost analysis counts a loop body
    once, so a scanned stack of 12 layers counts as one (ratio 0.37 for
    gpt-small)."""
    seq, rows = 256, 2
    run = config_lib.build(None, {"model.name": model, "parallel.mesh": "fsdp=1",
                                  "data.seq_len": seq, "train.batch_size": rows,
                                  "activations.remat": remat, "model.scan_layers": False})
    build, _ = models.for_run(run.model, 50257 if model.startswith("gpt") else 32000)
    job = job_lib.prepare(run, build, jax.devices()[:1])
    cost = job.compile_train_step().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    counted = cost["flops"] / (rows * seq)
    ours = flops.StepFlops.of(job.model, seq, job.hooks.remat)
    assert ours.hardware == pytest.approx(counted, rel=0.05)
    if remat == "full":  # the recompute is counted: the model figure alone would be off
        assert ours.hardware > 1.05 * ours.model


def test_recompute_follows_what_the_policy_keeps():
    """gpt-small's block under each policy: full rebuilds every matmul but
    the last (its output only feeds the residual); save_names rebuilds the
    scores (the probabilities are not kept) and the output projection (the
    residual sum before the second norm needs it)."""
    cfg = models.config("gpt-small", 50257)
    ops, D, F, T = cfg.block_ops(1024), cfg.d_model, cfg.d_mlp, 1024
    assert flops.recomputed(ops, Remat("none").keeps) == 0
    assert flops.recomputed(ops, Remat("dots_saveable").keeps) == 0
    assert flops.recomputed(ops, Remat("full").keeps) == 2 * (3 * D * D + D * D + D * F) + 4 * T * D
    saved = Remat("save_names", ("qkv", "attn_ctx", "mlp_hidden"))
    assert flops.recomputed(ops, saved.keeps) == 2 * D * D + 2 * T * D


def test_the_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_JAX_CACHE", str(tmp_path))
    first = flops.cpu_peak("float32", 8)
    cached = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert len(cached) == 1 and list(cached.values())[0]["flops"] == pytest.approx(first.flops * 8)
    quiet = {"flops": 8e12, "date": "2026-01-01 00:00 UTC", "others_busy": 0.0}
    (tmp_path / "cpu_peak.json").write_text(json.dumps({k: quiet for k in cached}))
    peak = flops.cpu_peak("float32", 8)
    assert peak.flops == 1e12  # read back, not measured again
    assert "8000 GFLOP/s measured by a 2048^3 float32 matmul on this host on 2026-01-01" \
        in peak.source


def _spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_a_peak_probed_under_load_is_probed_again_by_the_next_run(tmp_path, monkeypatch):
    """Beside one busy process per core the probe sees the others' share of
    the CPU and says so; the next run probes again, and keeps a quiet probe
    or the faster of two loaded ones."""
    monkeypatch.setenv("ZERO_JAX_CACHE", str(tmp_path))
    busy = _spinners(os.cpu_count() or 1)
    try:
        time.sleep(0.5)  # each has started spinning
        loaded = flops.cpu_peak("float32", 1)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    cache = tmp_path / "cpu_peak.json"
    (key, entry), = json.loads(cache.read_text()).items()
    assert entry["others_busy"] >= cpu_peak.QUIET and "so the next run probes again" in loaded.source
    cache.write_text(json.dumps({key: {**entry, "flops": 1.0}}))  # a figure no probe reads
    again = flops.cpu_peak("float32", 1)
    assert again.flops > 1.0 and json.loads(cache.read_text())[key]["flops"] == again.flops
    # A cache written before probes recorded their load: its figure is probed again too.
    cache.write_text(json.dumps({key: 1.0}))
    assert flops.cpu_peak("float32", 1).flops > 1.0


def test_a_step_above_the_peak_bounds_mfu_and_marks_the_peak_for_a_new_probe(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("ZERO_JAX_CACHE", str(tmp_path))
    key = cpu_peak.host_key("float32")
    low = {"flops": 1e9, "date": "2026-01-01 00:00 UTC", "others_busy": 0.0}
    (tmp_path / "cpu_peak.json").write_text(json.dumps({key: low}))
    t = flops.Throughput(flops.StepFlops(1e6, 2e6), 1, flops.cpu_peak("float32", 1))
    fields = t.fields(tokens_per_s=1e4)  # 2e10 hardware FLOP/s, 20x the cached peak
    assert fields["hfu"] == 1.0 and fields["mfu"] == 0.5
    assert t.fields(tokens_per_s=100)["mfu"] == pytest.approx(0.1)  # below the peak: as before
    t.check_peak([{"hardware_tflops_per_device": 0.02}])
    assert json.loads((tmp_path / "cpu_peak.json").read_text())[key]["reprobe"] is True
    assert flops.cpu_peak("float32", 1).flops != 1e9  # probed again


def test_processes_launched_on_one_host_share_its_peak(tmp_path, monkeypatch):
    """Under scripts/launch.py every process runs on the same cores: each
    device's share of the probed peak divides by all of their devices."""
    from zero_jax.runtime import cpu
    from zero_jax.runtime import distributed

    monkeypatch.setenv("ZERO_JAX_CACHE", str(tmp_path))
    (tmp_path / "cpu_peak.json").write_text(json.dumps({cpu_peak.host_key("float32"): {
        "flops": 8e12, "date": "2026-01-01 00:00 UTC", "others_busy": 0.0}}))
    cpu_device = jax.devices()[0]
    alone = flops.device_peak(cpu_device, "float32").flops
    monkeypatch.setenv(cpu.ENV_LAUNCHED, "2")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "4")
    assert alone == 8e12 / jax.local_device_count()
    assert flops.device_peak(cpu_device, "float32").flops == alone / 4
