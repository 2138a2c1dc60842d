"""Bytes per device: the ZeRO formula, the actual shardings and the compiler agree."""

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

import models
from tests.helpers import make_job
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import memory
from zero_jax.runtime import procmem

STATES = ("params", "grads", "opt_state")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_bytes_equal_the_formula_where_dimensions_divide(corpus, stage):
    # Every gpt-tiny array has a dimension divisible by 8, and nothing is left whole.
    job = make_job(corpus, zero_stage=stage, min_shard_elements=0)
    assert job.state_plan.specs.replicated == ()
    assert memory.sharded(job.state_plan) == pytest.approx(memory.theory(job.state_plan), rel=0, abs=0)


def _gpt_small(stage, mesh="fsdp=8"):
    run = config_lib.build(None, {"model.name": "gpt-small", "parallel.mesh": mesh,
                                  "parallel.zero_stage": stage, "data.seq_len": 1024,
                                  "train.batch_size": 8})
    return job_lib.prepare(run, models.builder("gpt-small", 50257))


def test_gpt_small_stage_ratios_match_the_zero_paper():
    """fp32 Adam: 4 + 4 + 8 bytes per parameter; stages 1-3 keep 9, 5.5 and 2 of 16."""
    totals = [sum(memory.sharded(_gpt_small(s).state_plan).values()) for s in range(4)]
    psi = memory.param_count(_gpt_small(0).state_plan)
    assert 124e6 < psi < 125e6  # GPT-2 small with its 50257-token vocabulary
    assert totals[0] == pytest.approx(16 * psi, rel=1e-6)  # 16 bytes + Adam's step count
    for stage, expected in zip((1, 2, 3), (9 / 16, 5.5 / 16, 2 / 16)):
        assert totals[stage] / totals[0] == pytest.approx(expected, rel=0.01), stage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_arguments_are_the_sharded_state_and_batch(corpus, stage):
    job = make_job(corpus, zero_stage=stage)
    compiled_step = job.compile_train_step()
    compiled = memory.compiled(compiled_step)
    sharded = memory.sharded(job.state_plan)
    batch = sum(math.prod(job.state_plan.batch_sharding.shard_shape(b.shape)) * b.dtype.itemsize
                for b in job.abstract_batch.values())  # tokens and loss mask
    scalars = sum(x.size * x.dtype.itemsize for x in
                  jax.tree.leaves((job.state_plan.abstract.step, job.state_plan.abstract.loss_scale)))
    state = sharded["params"] + sharded["opt_state"] + scalars  # + step, loss-scale scalars
    assert compiled["argument_bytes"] == state + batch
    # Outputs: the same state, the scalar metrics, and XLA's 8-byte pointer per output.
    metrics = jax.tree.leaves(compiled_step.out_info[1])
    metric_bytes = sum(m.size * m.dtype.itemsize for m in metrics)
    outputs = len(jax.tree.leaves(job.state_plan.abstract)) + len(metrics)
    assert state + metric_bytes <= compiled["output_bytes"] <= state + metric_bytes + 8 * (outputs + 1)


def test_reducing_each_microbatch_shards_the_accumulator(corpus, stage=3):
    """The accumulator's memory is what --grad-reduce trades for traffic.

    Reducing once per step (the default below ZeRO-3) accumulates every
    device's full partial sum; reducing each microbatch into the sharded
    gradient layout (ZeRO-3's default) keeps the accumulator, and the
    microbatch's reduced gradient, at 1/N: compiled temporaries drop by
    2 (N - 1)/N of the gradient bytes.
    """
    temps = {}
    for reduce in ("step", "microbatch"):
        job = make_job(corpus, zero_stage=stage, microbatches=4, batch_size=32, seq_len=128,
                       min_shard_elements=0, grad_reduce=reduce)
        temps[reduce] = memory.compiled(job.compile_train_step())["temp_bytes"]
    grads = sum(x.size * 4 for x in jax.tree.leaves(job.state_plan.abstract.params))
    one_copy = 7 / 8 * grads  # (N-1)/N of the gradient bytes, N = 8
    saving = temps["step"] - temps["microbatch"]
    print(f"stage {stage}: gradients {grads} B; temporaries {temps}: saving {saving} B = "
          f"{saving / one_copy:.3f} x (N-1)/N of the gradients")
    assert saving == pytest.approx(2 * one_copy, rel=0.05)


ROOT = Path(__file__).resolve().parent.parent


def test_a_model_that_cannot_fit_is_refused_before_anything_is_allocated(tmp_path):
    """mixtral-8x7b on 8 CPU devices: 747 GB of model states on this host.
    The run stops with one line before compiling or allocating: exit 2 in
    seconds, the process never past 2 GB resident."""
    room = procmem.available()
    if room and room[0] > 800e9:
        pytest.skip(f"this host has {room[0] / 1e9:.0f} GB available: mixtral-8x7b's states fit")
    out, err = tmp_path / "out", tmp_path / "err"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    # The run is started by a small Python that reports its children's peak
    # resident memory: Linux keeps a process's peak across fork and exec, so
    # a run started straight from this test process (gigabytes, late in a
    # suite) would report this process's peak, not its own. A run that
    # starts allocating instead is killed at the deadline.
    measure = ("import resource, subprocess, sys\n"
               "with open(sys.argv[1], 'w') as o, open(sys.argv[2], 'w') as e:\n"
               "    try:\n"
               "        rc = subprocess.run(sys.argv[3:], stdout=o, stderr=e, timeout=60).returncode\n"
               "    except subprocess.TimeoutExpired:\n"
               "        rc = 'killed-at-60s'\n"
               "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    started = time.monotonic()
    probe = subprocess.run([sys.executable, "-c", measure, str(out), str(err), sys.executable,
                            "scripts/train.py", "--model", "mixtral-8x7b", "--steps", "1"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    returncode, peak_kib = probe.stdout.split()
    peak = int(peak_kib) * 1024
    lines = err.read_text().splitlines()
    print(f"{seconds:.1f} s, peak resident {peak / 2**20:.0f} MiB: {lines}")
    assert returncode == "2" and len(lines) == 1, (returncode, lines, out.read_text())
    assert re.fullmatch(
        r"error: --model mixtral-8x7b \(46\.7B parameters\) does not fit this host: its model "
        r"states alone need 93\.4 GB per device \(params 23\.4 GB \+ grads 23\.4 GB \+ optimizer "
        r"state 46\.7 GB; ZeRO-3 over fsdp=8\), and 747\.2 GB on this host \(8 CPU devices share "
        r"its memory\), which has [\d.,]+ [kMG]B available \(.+\); nothing was allocated\. Use "
        r"about \d+ hosts like this one to shard over or a smaller model", lines[0]), lines[0]
    assert "start:" not in out.read_text()  # refused before the run's first line
    assert peak < 2 * 2**30 and seconds < 30


def test_the_fit_check_names_what_to_change(corpus):
    """The same check on gpt-tiny against a host with 1 MB to spare: refused,
    with the stage that would shard more; with the host's real memory, it fits."""
    job = make_job(corpus, zero_stage=1)
    with pytest.raises(memory.DoesNotFit) as refused:
        memory.check_fits(job.state_plan, "--model gpt-tiny", room=(10**6, "a test figure"))
    assert str(refused.value).startswith(
        "--model gpt-tiny (1.9M parameters) does not fit this host: its model states alone need "
        "17.0 MB per device (params 7.5 MB + grads 7.5 MB + optimizer state 1.9 MB; ZeRO-1 over "
        "fsdp=8), and 135.7 MB on this host (8 CPU devices share its memory), which has 1.0 MB "
        "available (a test figure); nothing was allocated. Use --zero-stage 3 (shards every "
        "state), more hosts to shard over or a smaller model"), refused.value
    memory.check_fits(job.state_plan, "--model gpt-tiny")  # this host's MemAvailable: it fits


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_available_memory_is_the_lower_of_meminfo_and_the_cgroup_limit(tmp_path, version):
    """A 4 GiB cgroup limit with 3 GiB used, 512 MiB of it reclaimable page
    cache, under a host with 20 GiB available: 1.5 GiB is what the run can
    take. Read from files laid out as /proc and /sys/fs/cgroup lay them out."""
    gib = 2**30
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc, {"meminfo": f"MemTotal: {32 * gib // 1024} kB\nMemAvailable: {20 * gib // 1024} kB\n"})
    if version == "v1":
        _write(proc, {"self/cgroup": "5:cpu:/\n4:memory:/jobs/run7\n0::/\n"})
        _write(cg / "memory", {"memory.limit_in_bytes": "9223372036854771712\n",
                               "memory.usage_in_bytes": f"{8 * gib}\n", "memory.stat": ""})
        _write(cg / "memory/jobs/run7", {
            "memory.limit_in_bytes": f"{4 * gib}\n", "memory.usage_in_bytes": f"{3 * gib}\n",
            "memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {gib // 2}\n"})
    else:
        _write(proc, {"self/cgroup": "0::/jobs/run7\n"})
        _write(cg, {"jobs/memory.max": "max\n", "jobs/memory.current": f"{8 * gib}\n",
                    "jobs/memory.stat": "", "jobs/run7/memory.max": f"{4 * gib}\n",
                    "jobs/run7/memory.current": f"{3 * gib}\n",
                    "jobs/run7/memory.stat": f"anon 1\ninactive_file {gib // 2}\n"})
    room, source = procmem.available(proc, cg)
    assert room == 3 * gib // 2 and source.endswith("run7"), (room, source)
    # Without a limit on the cgroup, MemAvailable.
    limit = cg / ("memory/jobs/run7/memory.limit_in_bytes" if version == "v1" else "jobs/run7/memory.max")
    limit.write_text("9223372036854771712\n" if version == "v1" else "max\n")
    assert procmem.available(proc, cg) == (20 * gib, "MemAvailable in /proc/meminfo")
