"""scripts/plot.py (its records read by zero_jax/runtime/metrics.py) and
`zero-jax bench` (zero_jax/cli/bench.py, the suites in zero_jax/bench/):
the plot run as a user runs it, the bench called in this process as a user
calls it (its main(argv)), on small inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import models
from zero_jax.bench import suites
from zero_jax.cli import bench
from zero_jax.runtime import metrics

ROOT = Path(__file__).resolve().parent.parent


def plot(*args) -> subprocess.CompletedProcess:
    """scripts/plot.py ARGS..., as a user runs it."""
    return subprocess.run([sys.executable, "scripts/plot.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def metrics_file(path: Path, steps: int, val_every: int, null_val: bool = False) -> Path:
    """Records as loop.py writes them: 4096 tokens a step, a null val_loss
    where a validation pass was non-finite."""
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.0 - 0.1 * step, "tokens_per_s": 8192.0,
                  "step_time_s": 0.5}
        if step % val_every == 0:
            record["val_loss"] = None if null_val and step == val_every else 5.1 - 0.1 * step
            if record["val_loss"] is None:
                record["non_finite"] = ["val_loss"]
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plot_writes_a_png_of_two_runs(tmp_path):
    a = metrics_file(tmp_path / "a.jsonl", 12, 4)
    b = metrics_file(tmp_path / "b.jsonl", 8, 2, null_val=True)
    out = tmp_path / "curves.png"
    p = plot(a, b, "-o", out)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000


def test_plot_counts_tokens_and_skips_nulls(tmp_path):
    records = metrics.read_records(metrics_file(tmp_path / "m.jsonl", 4, 2, null_val=True))
    tokens = metrics.tokens_seen(records)
    assert tokens == [4096, 8192, 12288, 16384]
    steps, seen, values = metrics.series(records, tokens, "val_loss")
    assert steps == [4] and seen == [16384]  # step 2's null left out


def test_plot_missing_file_is_one_line_exit_2(tmp_path):
    p = plot(tmp_path / "none.jsonl", "-o", tmp_path / "c.png")
    assert p.returncode == 2
    err = p.stderr
    assert err.startswith("error: ") and err.count("\n") == 1 and "none.jsonl" in err
    assert not (tmp_path / "c.png").exists()


def test_bench_one_case_reports_throughput_and_memory(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--cases", "gpt-tiny/fsdp1", "--steps", "2", "--warmup", "1",
                       "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "cpu" and set(doc["peak"]) == {"float32"}
    (case,) = doc["cases"]
    assert case["status"] == "ok", case.get("error")
    assert case["tokens_per_s"] > 0 and 0 < case["mfu"] and case["compile_s"] > 0
    assert case["step_time_s_min"] <= case["step_time_s_median"] <= case["step_time_s_max"]
    used = case["memory_bytes_per_device"]
    assert used["arguments"] > 0 and used["total"] >= used["temp"] > 0
    assert "gpt-tiny/fsdp1" in capsys.readouterr().out  # the table's row


def test_bench_gpu_ladder_stops_at_the_first_case_that_does_not_fit(tmp_path):
    """The gpu-1 selection on CPU: d64 fits under 10 MiB, d128 does not (its
    step needs ~16 MiB), so d512 is never compiled."""
    out = tmp_path / "bench.json"
    assert bench.main(["--suite", "gpu-1", "--dry-run", "--cases", "dry-*/none",
                       "--memory-limit", str(10 * 2**20), "--steps", "1", "--warmup", "0",
                       "--json-out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["name"], c["status"]) for c in cases] == [
        ("dry-d64/none", "ok"), ("dry-d128/none", "does not fit")]
    assert cases[1]["memory_bytes_per_device"]["total"] > 10 * 2**20


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0"),
    (["--cases", "no-such-case"], "--cases no-such-case"),
    (["--dry-run"], "--dry-run with --suite cpu"),
    (["--json-out", "/no/such/dir/b.json"], "--json-out"),
])
def test_bench_bad_arguments_exit_2_before_compiling(argv, message, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_bench_suites_are_well_formed():
    """Names unique; each gpu-1 ladder's rungs in order of size."""
    for cases in (suites.cpu_suite(), suites.gpu_suite(), suites.gpu_suite(dry_run=True)):
        assert len({c.name for c in cases}) == len(cases)
    for rungs in suites.GPU_LADDERS.values():
        shapes = [models.config(flat["model.name"], 50257) for flat, _ in rungs.values()]
        sizes = [c.n_layer * c.d_model ** 2 for c in shapes]  # parameters, give or take the embeddings
        assert sizes == sorted(sizes)
