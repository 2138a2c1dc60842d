"""The cost of one layout (choices.Choice) on a cluster, without the cluster.

`estimate` works from abstract shapes only (an AbstractMesh of the
cluster's size, nothing allocated, nothing compiled) and gives an
`Estimate`: the step's bytes per device (step_bytes.py) and its time
(step_time.py), beside the device's memory and its share of the host's.

  exact      the model states per device as stored (params, grads,
             opt_state), from the layout's shardings, and which of them are
             in host memory, from their memory kinds;
  estimated  what a step adds to them: gradient buffers, the activations
             the remat policy keeps (a pipeline: its stashed stage inputs
             and one chunk's), gathered ZeRO-3 weights, the update's
             working copies; and all of the time: each layer's kernels from
             their shapes (kernels.py; a pipeline: its schedule's cost,
             bubble and sends included), each mesh axis's exposed
             collectives over its link and, with offload, the host link and
             the host update (step_time.py).

A layout fits when the estimate and a reserve (choices.RESERVE_FRACTION:
what the runtime, collectives and fragmentation take beyond it) are within
the device's memory.

The search prunes with these, then compiles the best on simulated CPU
devices (`measure`) for the compiled memory and the collective bytes of the
real program, which replace the analytic traffic (`with_measured`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import memory
from zero_jax.planner import links
from zero_jax.planner.choices import Choice, Cluster
from zero_jax.planner.step_bytes import StepBytes, step_bytes
from zero_jax.planner.step_time import StepTime, step_time


# Not frozen: the search attaches the figures it measures (`compiled`).
@dataclasses.dataclass
class Estimate:
    """One layout's bytes per device and step time; figures in bytes and seconds."""

    choice: Choice
    memory: StepBytes  # the states and each phase of a step, per device
    time: StepTime  # compute and communication of a step
    hbm: int  # the device's memory
    host_limit: float  # this device's share of its node's host memory
    reserve: float = 0.0  # memory kept free beyond the estimate (Cluster.reserve_bytes)
    compiled: dict[str, Any] | None = None  # measure(): memory and collectives of the real program

    @property
    def peak_bytes(self) -> float:
        """The figure that decides fitting: the analytic estimate. The CPU
        compile widens bf16 temporaries, so its figure is an upper bound."""
        return self.memory.device_bytes

    @property
    def fits(self) -> bool:
        """The estimate and the reserve within the device's memory, and the
        host's share within the host's."""
        return (self.peak_bytes + self.reserve <= self.hbm
                and self.memory.host_bytes <= self.host_limit)

    @property
    def headroom(self) -> float:
        """Of the device's memory, what is left beyond the estimate and the reserve."""
        return 1 - (self.peak_bytes + self.reserve) / self.hbm


def estimate(job: job_lib.Job, choice: Choice, cluster: Cluster, platform: str = "gpu") -> Estimate:
    """Analytic bytes and time of `choice`, with `job` the abstract job of
    its mesh, ZeRO stage and stage cut (the rest is read from `choice`).
    `platform` "cpu" models XLA:CPU's reduce-scatter (an all-reduce and a
    slice), to compare with programs compiled here."""
    dev = cluster.device
    return Estimate(choice, step_bytes(job, choice, platform), step_time(job, choice, cluster),
                    dev.hbm_bytes, dev.host_bytes_per_node / cluster.per_node,
                    cluster.reserve_bytes)


def with_measured(est: Estimate, measured: dict[str, Any], cluster: Cluster) -> Estimate:
    """`est` with the compiled program's figures: its memory beside the
    estimate, and its collective bytes per axis in place of the analytic
    traffic (payload x ring factor over the axis's link), of which the same
    overlap model leaves what it leaves exposed (StepTime.exposed)."""
    comm = {axis: est.time.exposed(axis, seconds) for axis, seconds in
            _measured_comm(est.choice, measured["collectives"], cluster).items()}
    if est.choice.pipe > 1:  # the schedule's sends stay as the cost model counts them
        comm["pipe"] = est.time.comm_s.get("pipe", 0.0)
    for key in ("host link", "host update"):  # no collectives: as estimated
        if key in est.time.comm_s:
            comm[key] = est.time.comm_s[key]
    return dataclasses.replace(est, time=dataclasses.replace(est.time, comm_s=comm),
                               compiled=measured)


def against_compiled(est: Estimate, cpu_wider: str = "") -> str | None:
    """Which of the estimate (`GB`) and the compiled figure (`CPU GB`) bounds
    which, where both are known. `cpu_wider` names how the program compiled
    here holds more than a GPU's ("bf16": 16-bit floats computed in float32;
    "scores": XLA's attention writes out the scores cuDNN's fused kernel
    never stores), so that a compiled figure above the estimate bounds the
    GPU's from above; with nothing named, it says the estimate may be low."""
    c = est.compiled or {}
    if "temp_bytes" not in c:
        return None
    cpu, gb = c["argument_bytes"] + c["temp_bytes"], est.peak_bytes
    if abs(cpu - gb) <= 0.1 * gb:
        return "within 10%"
    if cpu < gb:
        return "GB bounds CPU GB"
    return f"CPU GB bounds ({cpu_wider})" if cpu_wider else "GB may be low"


def _measured_comm(choice: Choice, collectives: dict[str, float],
                   cluster: Cluster) -> dict[str, float]:
    """Seconds per group of mesh axes of the collectives measured as
    {"op@axis,axis": payload bytes}; a collective over no named axis counts
    as over data."""
    sizes = {"pipe": choice.pipe, "data": choice.data // choice.expert, "tensor": choice.tensor,
             "expert": choice.expert, "context": choice.context, "fsdp": 1}
    comm: dict[str, float] = {}
    for key, payload in collectives.items():
        op, _, axes = key.partition("@")
        names = [a for a in axes.split(",") if a in sizes] or ["data"]
        n = math.prod(sizes[a] for a in names)
        link = min(choice.link_bw(cluster, a) for a in names)
        where = "+".join(names)
        comm[where] = comm.get(where, 0.0) + payload * links.ring_factor(op, max(n, 2)) / link
    return comm


def measure(flat: dict[str, Any], build_model) -> dict[str, Any]:
    """Compile the run on this process's devices: memory and collective bytes."""
    run = config_lib.build(None, flat)
    job = job_lib.prepare(run, build_model)
    compiled, text = job.compile_with_text()
    m = memory.compiled(compiled)
    traffic = job.collectives(text).measured
    return {"argument_bytes": m["argument_bytes"], "temp_bytes": m["temp_bytes"],
            "collectives": traffic.by_op, "collective_bytes": traffic.total}
