"""Start-up settings for several processes, and the step watchdog (in-process)."""

import io
import time

import pytest

from zero_jax.runtime import distributed
from zero_jax.runtime.distributed import DistributedConfig, DistributedError
from zero_jax.runtime.watchdog import EXIT_STUCK, StepWatchdog


def test_one_process_sets_nothing_up():
    assert distributed.settings(DistributedConfig(), environ={}) is None
    single = {"ZERO_JAX_COORDINATOR": "127.0.0.1:1234", "ZERO_JAX_NUM_PROCESSES": "1",
              "ZERO_JAX_PROCESS_ID": "0"}
    assert distributed.settings(DistributedConfig(), environ=single) is None
    assert distributed.settings(DistributedConfig(), environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None


def test_launcher_environment_and_flags_give_explicit_settings():
    env = {"ZERO_JAX_COORDINATOR": "127.0.0.1:1234", "ZERO_JAX_NUM_PROCESSES": "4",
           "ZERO_JAX_PROCESS_ID": "3"}
    cfg = DistributedConfig(heartbeat_timeout_s=20, barrier_timeout_s=60)
    assert distributed.settings(cfg, environ=env) == {
        "coordinator_address": "127.0.0.1:1234", "num_processes": 4, "process_id": 3,
        "initialization_timeout": 60, "heartbeat_timeout_seconds": 20}
    flags = DistributedConfig(coordinator="10.0.0.1:99", num_processes=2, process_id=1)
    assert distributed.settings(flags, environ=env)["process_id"] == 1  # flags win


def test_clusters_jax_detects_pass_only_the_timeouts():
    for env in ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, {"OMPI_COMM_WORLD_SIZE": "4"},
                {"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}):
        assert distributed.settings(DistributedConfig(barrier_timeout_s=9), environ=env) == {
            "initialization_timeout": 9, "heartbeat_timeout_seconds": 100}


def test_an_incomplete_explicit_setting_is_an_error():
    with pytest.raises(DistributedError, match="process_id=5"):
        distributed.settings(DistributedConfig(coordinator="h:1", num_processes=2, process_id=5), environ={})


def _steps(w, n, seconds):
    for i in range(n):
        w.started(i)
        time.sleep(seconds)
        w.finished(i)


def test_watchdog_reports_then_stops_a_step_far_past_the_median():
    out, exits = io.StringIO(), []
    w = StepWatchdog(warn=3, stop=20, min_s=0, out=out, exit_fn=exits.append, poll_s=0.005)
    _steps(w, 4, 0.01)
    w.started(4)
    time.sleep(0.08)  # ~8 x the median: reported, not stopped
    assert "warning: step 5 has run" in out.getvalue() and not exits
    time.sleep(0.4)  # past 20 x
    w.close()
    assert exits == [EXIT_STUCK]
    assert "error: step 5 has run" in out.getvalue() and "a peer is stuck or dead" in out.getvalue()


def test_watchdog_ignores_short_steps_and_the_first_ones():
    out, exits = io.StringIO(), []
    w = StepWatchdog(warn=2, stop=3, min_s=0.3, out=out, exit_fn=exits.append, poll_s=0.005)
    w.started(0)
    time.sleep(0.05)  # no median yet
    w.finished(0)
    _steps(w, 3, 0.005)
    w.started(3)
    time.sleep(0.1)  # 20 x the median, but under min_s
    w.finished(3)
    w.close()
    assert out.getvalue() == "" and exits == []


def test_a_step_resumed_after_a_pause_is_watched_but_not_a_sample():
    """What remains of a step under way before a save is timed from the
    save's end: it still trips the watchdog, but its short partial time
    never enters the median (which would lower every later limit)."""
    out, exits = io.StringIO(), []
    w = StepWatchdog(warn=3, stop=20, min_s=0, out=out, exit_fn=exits.append, poll_s=0.005)
    _steps(w, 3, 0.02)
    limits = w.limits()
    w.started(3, resumed=True)
    w.finished(3)  # at once: a partial time of about zero
    assert w.limits() == limits
    w.started(4, resumed=True)
    time.sleep(0.6)  # past 20 x the median
    w.close()
    assert exits == [EXIT_STUCK] and "error: step 5 has run" in out.getvalue()


def test_plan_says_which_axes_cross_hosts():
    from zero_jax.sharding import mesh
    from zero_jax.report import summary
    assert summary.interconnect(mesh.load("gpu-4x8").resolve(32)) == \
        "data: across hosts (dcn 4); fsdp: inside each host (ici 8)"
    assert summary.interconnect(mesh.load("fsdp=4,tensor=2").resolve(8)) == \
        "fsdp: inside each host (ici 4); tensor: inside each host (ici 2)"


def test_plan_reads_which_axes_cross_processes_from_the_devices():
    """Over several processes the devices say where an axis runs: an inline
    fsdp=8 (all [ici] as written) on 4 processes of 2 devices spans them."""
    import numpy as np

    from zero_jax.sharding import mesh
    from zero_jax.report import summary
    four_by_two = np.repeat(np.arange(4), 2).reshape(1, 1, 8, 1, 1, 1)  # process of each device
    assert summary.interconnect(mesh.load("fsdp=8").resolve(8), four_by_two) == \
        "fsdp: across processes (dcn 4 x ici 2)"
    two_by_four = np.repeat(np.arange(2), 4).reshape(1, 2, 4, 1, 1, 1)
    assert summary.interconnect(mesh.load("cpu-2x4").resolve(8), two_by_four) == \
        "data: across processes (dcn 2); fsdp: inside each process (ici 4)"
