"""Every device of a pipelined step issues its collectives in one order:
each schedule at every microbatch count 1..8 on two meshes trains a step,
its loss that of the 1-device step on the same batch.

A disagreement on that order does not give a wrong number here: the
program hangs until XLA:CPU's rendezvous aborts it (on a GPU cluster it
hangs). So the walk runs in its own process per mesh (tests/pipeline_walk.py),
and a failure names the configuration that hung. These are the
configurations that hung on jaxlib 0.11.2 before the step asked XLA:CPU for
no YNN fusions (runtime/xla_options.py, docs/pipelines.md).

CI runs, per mesh, every microbatch count once with the schedules in
rotation, and the configurations that hung; ZERO_JAX_FULL_GRID=1 runs
all 64.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline_walk import MICROBATCHES
from zero_jax.pipeline.schedule import SCHEDULES

ROOT = Path(__file__).resolve().parent.parent
MESHES = ("pipe=2,fsdp=4", "pipe=4,data=2")
HUNG = {"pipe=2,fsdp=4": [("1f1b", 2)],
        "pipe=4,data=2": [("gpipe", 2), ("1f1b", 2), ("zb-h1", 2), ("zb-h1", 4)]}


def walk(mesh: str) -> list[tuple[str, int]]:
    if os.environ.get("ZERO_JAX_FULL_GRID"):
        return [(s, m) for s in SCHEDULES for m in MICROBATCHES]
    turn = MESHES.index(mesh)
    rotation = [(SCHEDULES[(m + turn) % len(SCHEDULES)], m) for m in MICROBATCHES]
    return rotation + [c for c in HUNG[mesh] if c not in rotation]


@pytest.mark.parametrize("mesh", MESHES)
def test_every_schedule_and_microbatch_count_trains(mesh):
    configs = walk(mesh)
    out = subprocess.run(
        [sys.executable, "-m", "tests.pipeline_walk", mesh, *(f"{s}:{m}" for s, m in configs)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200)
    lines = out.stdout.splitlines()
    ran = [line for line in lines if line.startswith("ok ")]
    assert out.returncode == 0, (
        f"on {mesh}, {lines[-1] if lines else 'nothing ran'} (exit {out.returncode})\n"
        + "\n".join(out.stderr.splitlines()[-5:]))
    assert len(ran) == len(configs), out.stdout
