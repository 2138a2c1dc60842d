"""The CPU backend reuses a step's freed temporaries instead of faulting them
in again each step (zero_jax/runtime/host_allocator.py), measured as the
minor page faults of each run of a program whose temporaries are too big
for glibc's heap by default."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from zero_jax.runtime import host_allocator

ROOT = Path(__file__).resolve().parent.parent

# A scan that stacks 64 MiB of outputs (above glibc's largest mmap threshold,
# 32 MiB): its temporaries are one block XLA:CPU allocates for each run.
PROBE = """
import json, resource, sys
from zero_jax.runtime import host_allocator
applied = host_allocator.keep_freed_memory()
import jax, jax.numpy as jnp

def f(x):
    def body(c, xi):
        h = jnp.tanh(xi + c)
        return c + h[0], h
    _, hs = jax.lax.scan(body, 0.0, x)
    return (hs * hs[::-1]).sum()

x = jnp.ones((64, 2**18), jnp.float32)
step = jax.jit(f).lower(x).compile()
for _ in range(3):
    step(x).block_until_ready()
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults,
                  "temp_pages": step.memory_analysis().temp_size_in_bytes // 4096}))
"""


def probe(setting: str | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", host_allocator.ENV, "JAX_PLATFORMS")}
    if setting:
        env[host_allocator.ENV] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(not host_allocator.cpu_only(), reason="an accelerator plugin is installed")
def test_a_run_reuses_the_previous_runs_temporaries():
    kept, system = probe(None), probe("system")
    assert kept["applied"] and not system["applied"]
    assert kept["temp_pages"] >= 16384  # the 64 MiB stack, so the comparison means something
    # glibc's default maps and unmaps the block each run: every page faults again.
    assert statistics.median(system["faults"]) > kept["temp_pages"] / 2, system
    # Kept: the heap already holds it (a run may now and then land elsewhere).
    assert statistics.median(kept["faults"]) < kept["temp_pages"] / 20, kept


@pytest.mark.parametrize("environ,expected", [
    ({"JAX_PLATFORMS": "cpu"}, True),
    ({"JAX_PLATFORMS": "cuda"}, False),
    ({"JAX_PLATFORMS": "cuda,cpu"}, False),
    ({"JAX_PLATFORMS": " cpu "}, True),
])
def test_jax_platforms_decides_where_it_is_set(environ, expected):
    assert host_allocator.cpu_only(environ) == expected


def test_system_leaves_the_allocator_alone():
    assert host_allocator.applies({"JAX_PLATFORMS": "cpu"})
    assert not host_allocator.applies({host_allocator.ENV: "system", "JAX_PLATFORMS": "cpu"})
