"""`--devices N`: which count wins, and the errors that say how to get one."""

import subprocess
import sys
from pathlib import Path

import jax
import pytest

from zero_jax.runtime import cpu
from zero_jax.sharding import mesh as mesh_lib

FORCED = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
LAUNCHED = {cpu.ENV_LAUNCHED: "2", **FORCED}


@pytest.mark.parametrize("flag,default,environ,expected", [
    (8, None, {}, 8),  # --devices
    (8, None, FORCED, 8),  # --devices over XLA_FLAGS
    (None, None, FORCED, None),  # XLA_FLAGS alone: left to JAX
    (None, 8, FORCED, None),  # XLA_FLAGS over a script's default
    (None, 8, {}, 8),  # the script's default
    (None, None, {}, None),  # nothing: JAX's one device
    (8, 8, LAUNCHED, None),  # the launcher over everything
])
def test_which_count_wins(flag, default, environ, expected):
    assert cpu.wanted(flag, default, environ) == expected


def test_the_last_count_in_xla_flags_counts():
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_dump_to=/tmp/x "
                          "--xla_force_host_platform_device_count=6"}
    assert cpu.xla_flags_count(flags) == 6
    assert cpu.xla_flags_count({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}) is None


def test_a_started_backend_keeps_its_count():
    assert cpu.simulate(jax.device_count()) == 8  # the count it has: nothing to do
    with pytest.raises(cpu.DevicesError, match="--devices 4: JAX's backend has already started "
                                               "with 8 CPU device"):
        cpu.simulate(4)
    with pytest.raises(cpu.DevicesError, match="--devices 0: give a device count of at least 1"):
        cpu.simulate(0)


def test_a_mesh_short_of_devices_says_how_to_simulate_them():
    with pytest.raises(mesh_lib.MeshError, match=r"needs 16 devices but 8 are present; .* on a CPU, "
                                        r"simulate them with --devices 16 \(or XLA_FLAGS="):
        mesh_lib.load("fsdp=16").resolve(8)
    assert "-n times --devices-per-process equal 16" in cpu.fix_hint(16, LAUNCHED)


def test_bench_pipeline_short_of_devices_stops_with_one_line():
    """The benchmark run as a user runs it, on the suite's 8 devices (XLA_FLAGS)."""
    p = subprocess.run([sys.executable, "scripts/bench_pipeline.py", "--mesh", "pipe=2,fsdp=8"],
                       cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "simulate them with --devices 16" in p.stderr
