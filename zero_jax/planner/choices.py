"""The candidate layouts of a training run on a cluster.

A `Choice` is one layout: pipe, tensor and data-parallel sizes, ZeRO stage,
activation policy, microbatch size and count, pipeline schedule, host
offload. `choices` enumerates every layout that divides the model and the
cluster; `abstract_job` turns one into the job its cost is read from
(cost.py), on an AbstractMesh of the cluster's size: nothing allocated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

from jax.sharding import AbstractMesh, AxisType

from zero_jax import config as config_lib, job as job_lib
from zero_jax.model import exchange
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.planner import links
from zero_jax.runtime.device_kinds import Device
from zero_jax.sharding import mesh as mesh_lib


# What a device's memory must keep free beyond the estimate: collective
# buffers, cuBLAS/cuDNN workspaces, the runtime's own context and allocator
# fragmentation. XLA takes a fixed share of GPU memory for its pool
# (XLA_CLIENT_MEM_FRACTION, 0.75 by default: JAX's GPU memory guide) and
# leaves the rest to those; 10% is what is left at 0.9, the share large runs
# raise it to, and 4 GB the floor on small devices, where NCCL's channels,
# the CUDA context and the workspaces (about 1, 0.5 and 1 GB) do not shrink.
RESERVE_FRACTION = 0.10
RESERVE_FLOOR = 4e9


@dataclasses.dataclass(frozen=True)
class Cluster:
    device: Device
    nodes: int
    per_node: int  # devices per node
    reserve_gb: float | None = None  # memory kept free per device (None: the default)

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    @property
    def reserve_bytes(self) -> float:
        """Memory per device a layout may not plan to use (RESERVE_FRACTION)."""
        if self.reserve_gb is not None:
            return self.reserve_gb * 1e9
        return max(RESERVE_FRACTION * self.device.hbm_bytes, RESERVE_FLOOR)


@dataclasses.dataclass(frozen=True, order=True)
class Choice:
    """One layout of the run."""

    pipe: int
    tensor: int
    data: int
    zero: int
    remat: str  # activation policy (remat.py)
    micro: int  # rows per microbatch per data-parallel replica
    microbatches: int
    schedule: str = ""  # with pipe > 1
    virtual: int = 1
    offload: str = ""  # in host memory: "" nothing, "opt" the optimizer state, "opt+params" both
    tables: str = "rows"  # with pipe > 1: how the loops use the embedding and head (--pipeline-tables)
    expert: int = 1  # of the data-parallel devices, the expert axis (a mixture of experts' split)
    context: int = 1  # devices each sequence is split over (context parallelism), beside data
    quantized: str = ""  # ZeRO-3: ZeRO++'s int8 gathers ("qwZ"), and gradient reductions ("qwZ+qgZ")

    @property
    def label(self) -> str:
        s = f"{self.schedule}{f' v={self.virtual}' if self.virtual > 1 else ''}" if self.pipe > 1 else "-"
        ep = f" EP={self.expert}" if self.expert > 1 else ""
        cp = f" CP={self.context}" if self.context > 1 else ""
        return (f"PP={self.pipe} TP={self.tensor}{cp} DP={self.data}{ep} ZeRO-{self.zero} {self.remat} "
                f"mb={self.micro}x{self.microbatches} {s}"
                + (" tables=whole" if self.pipe > 1 and self.tables == "whole" else "")
                + (f" offload={self.offload}" if self.offload else "")
                + (f" {self.quantized}" if self.quantized else ""))

    def mesh(self, cluster: Cluster) -> dict[str, dict[str, int]]:
        """[ici] and [dcn] sizes: tensor inside a node first, then context
        and expert (where there are), data, pipe (DP = data x expert)."""
        room = cluster.device.fast_domain if cluster.device.ici_domain else cluster.per_node
        ici, dcn = {}, {}
        expert = (("expert", self.expert),) if self.expert > 1 else ()
        context = (("context", self.context),) if self.context > 1 else ()
        for axis, size in (("tensor", self.tensor), *context, *expert,
                           ("data", self.data // self.expert), ("pipe", self.pipe)):
            inside = math.gcd(size, room)
            room //= inside
            ici[axis], dcn[axis] = inside, size // inside
        return {"ici": ici, "dcn": dcn}

    def crosses_nodes(self, cluster: Cluster, axis: str) -> bool:
        return self.mesh(cluster)["dcn"][axis] > 1

    def link_bw(self, cluster: Cluster, axis: str) -> float:
        """Bytes/s per device of a ring over `axis`: it runs at the slowest link it crosses."""
        dev = cluster.device
        return dev.inter_node_bw if self.crosses_nodes(cluster, axis) else dev.intra_node_bw

    def link(self, cluster: Cluster, *axes: str) -> links.Link:
        """The slowest link a collective over `axes` crosses."""
        dev = cluster.device
        across = any(self.crosses_nodes(cluster, a) for a in axes)
        return links.Link(min(self.link_bw(cluster, a) for a in axes),
                          dev.inter_node_latency if across else dev.intra_node_latency,
                          dev.collective_latency)

    def flat(self, base: dict[str, Any]) -> dict[str, Any]:
        """Run-config fields (section.field) of this layout on top of `base`."""
        expert = f"expert={self.expert}," if self.expert > 1 else ""
        context = f"context={self.context}," if self.context > 1 else ""
        mesh = (f"pipe={self.pipe},data={self.data // self.expert},{expert}{context}"
                f"tensor={self.tensor}")
        out = {**base, "parallel.mesh": mesh,
               "parallel.zero_stage": self.zero, "activations.remat": self.remat,
               "train.microbatches": self.microbatches,
               # The vocabulary padded so that tensor and pipe split the embedding.
               "model.vocab_multiple": self.tensor * self.pipe * 8}
        if self.pipe > 1:
            out["parallel.pipeline_schedule"] = self.schedule
            out["parallel.virtual_stages"] = self.virtual
            out["parallel.pipeline_tables"] = self.tables
        if self.offload:
            out["offload.optimizer"] = True
            out["offload.params"] = self.offload == "opt+params"
        if self.quantized:
            out["zero.quantized_weights"] = True
            out["zero.quantized_grads"] = self.quantized == "qwZ+qgZ"
        return out


OFFLOADS = ("", "opt", "opt+params")


@dataclasses.dataclass(frozen=True)
class Space:
    """The values the search tries for each choice a mesh shape leaves open."""

    stages: tuple[int, ...] = (0, 1, 2, 3)  # ZeRO stages
    remats: tuple[str, ...] = ("full", "none")  # activation policies
    micros: tuple[int, ...] = (1, 2, 4, 8)  # microbatch sizes (rows per device)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")  # with a pipeline
    offloads: tuple[str, ...] = OFFLOADS  # "" none, "opt" the optimizer state, "opt+params" both
    tables: tuple[str, ...] = ("rows", "whole")  # how a pipeline uses the tables
    # ZeRO++ at ZeRO-3: off, and on as far as the layout allows (qgZ not with a pipeline)
    quantized: tuple[bool, ...] = (False, True)


def choices(model_cfg, cluster: Cluster, global_batch: int, space: Space = Space(),
            seq_len: int = 0) -> list[Choice]:
    """Every layout of `space` that divides the model and the cluster: tensor
    inside a node and dividing the heads, pipe up to the layer count, the
    global batch split evenly, and a pipeline with at least as many
    microbatches as stages, its tables used either way (`space.tables`;
    search.estimate_all drops "whole" where no table is in row blocks, the
    two being one layout then).
    Offload where the device kind has host figures: the optimizer state at
    ZeRO-1 and up, the parameters too at ZeRO-3 without a pipeline (job.py).
    A mixture of experts also takes every expert axis that divides both its
    experts and the data-parallel devices. For sequences of LONG tokens or
    more, the devices beside tensor and pipe are also split between
    `context` (each sequence over c of them, 2c dividing it) and data.
    At ZeRO-3, each layout with and without ZeRO++'s quantized collectives
    (`space.quantized`): qwZ and qgZ, or qwZ alone under a pipeline or
    over `context`."""
    stages, remats, micros, schedules, offloads, tables = (
        space.stages, space.remats, space.micros, space.schedules, space.offloads, space.tables)

    def quantized(zero: int, pipe: int, context: int) -> list[str]:  # quantized.check's rule
        on = "" if zero < 3 else "qwZ+qgZ" if pipe == 1 and context == 1 else "qwZ"
        return sorted({on if q else "" for q in space.quantized})
    if not cluster.device.can_offload:
        offloads = tuple(o for o in offloads if not o)
    out = []
    experts = getattr(model_cfg, "n_experts", 0)
    shapes = [(tensor, pipe, rest // context, context)
              for tensor, pipe, rest in mesh_shapes(model_cfg, cluster)
              for context in _contexts(rest, seq_len)]
    for tensor, pipe, data, context in shapes:
        if global_batch % data:
            continue
        rows = global_batch // data
        for micro in micros:
            if rows % micro:
                continue
            m = rows // micro
            if pipe > 1 and m < pipe:
                continue
            plans = [("", 1)] if pipe == 1 else [
                (s, v) for s in schedules for v in ((2,) if s == "interleaved" else (1,))
                if not (s == "interleaved" and model_cfg.n_layer < pipe * v)]
            for zero in stages:
                kept = [o for o in offloads if not o or (zero >= 1 and (
                    o == "opt" or (zero == 3 and pipe == 1)))]
                for remat in remats:
                    for schedule, v in plans:
                        out += [Choice(pipe, tensor, data, zero, remat, micro, m, schedule, v, o,
                                       t, e, context, q)
                                for o in kept for t in (tables if pipe > 1 else ("rows",))
                                for e in _divisors(math.gcd(experts, data) if experts else 1)
                                for q in quantized(zero, pipe, context)]
    return out


def mesh_shapes(model_cfg, cluster: Cluster) -> list[tuple[int, int, int]]:
    """(tensor, pipe, data) of every mesh the model fits on the cluster:
    tensor inside a node and dividing the heads and the MLP, pipe up to the
    layer count, data the rest of the devices."""
    n = cluster.size
    return [(tensor, pipe, n // (tensor * pipe))
            for tensor in _divisors(min(cluster.per_node, n))
            if not (model_cfg.n_head % tensor or _mlp(model_cfg) % tensor or n % tensor)
            for pipe in _divisors(n // tensor) if pipe <= model_cfg.n_layer]


# Sequences this long or longer are also split over `context` by the search
# (a shorter one's activations are a small part of a device's memory).
LONG = 16384


def _contexts(devices: int, seq_len: int) -> list[int]:
    """Context sizes for `devices` beside tensor and pipe: 1, and for long
    sequences every divisor c whose 2c divides the sequence."""
    if seq_len < LONG:
        return [1]
    return [c for c in _divisors(devices) if seq_len % (2 * c) == 0]


def _mlp(model_cfg) -> int:
    """The MLP width tensor splits: each expert's in a mixture of experts."""
    return getattr(model_cfg, "expert_mlp", model_cfg.d_mlp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def abstract_job(flat: dict[str, Any], build_model, devices: int) -> job_lib.Job:
    """The job of a run config on an abstract mesh of `devices` (no devices needed)."""
    run = config_lib.build(None, flat)
    shape = job_lib.mesh_config(run).resolve(devices)
    mesh = AbstractMesh(tuple(shape.sizes.values()), mesh_lib.AXES,
                        axis_types=(AxisType.Auto,) * len(mesh_lib.AXES))
    return job_lib.prepare_on(run, build_model, mesh, shape)


def pipeline_schedule(choice: Choice) -> schedule_lib.Schedule:
    """The tick table of a pipelined `choice` (pipe > 1); layouts that differ
    only in stage, policy or offload share one."""
    return _built(choice.schedule, choice.pipe, choice.microbatches, choice.virtual)


# Cached: a search estimates many layouts of each pipeline shape, and a long
# schedule (12 stages x 128 microbatches: about 20 ms) takes longer to build
# than the estimate that reads it.
@functools.lru_cache(maxsize=256)
def _built(name: str, p: int, m: int, v: int) -> schedule_lib.Schedule:
    return schedule_lib.build(name, p, m, v)


class ExpertSpan(NamedTuple):
    """How a layout's expert axis sits on the cluster's nodes."""

    per_node: int  # its devices on each node
    nodes: int  # the nodes it spans
    reach: int  # at most how many of them one token's copies reach
    two_hops: bool  # whether the dispatch crosses nodes in two hops (exchange.node_size)


def expert_span(cfg, dispatch: str, choice: Choice, cluster: Cluster) -> ExpertSpan:
    """The expert axis on the nodes under `--expert-dispatch dispatch`; a
    token reaches topk_group nodes' worth where the routing groups are
    whole nodes' experts (DeepSeek-V3's 8 groups on 8 nodes), else up to
    all of them, and never more than its k copies."""
    layout = choice.mesh(cluster)
    here, nodes = (layout["ici"]["expert"], layout["dcn"]["expert"]) if choice.expert > 1 \
        else (1, 1)
    groups, limit = getattr(cfg, "n_group", 1), getattr(cfg, "topk_group", 1)
    aligned = groups > 1 and (groups % nodes == 0 or nodes % groups == 0)
    reach = limit * max(1, nodes // groups) if aligned else nodes
    return ExpertSpan(here, nodes, min(reach, nodes, cfg.n_experts_per_tok),
                      nodes > 1 and bool(exchange.node_size(dispatch, here, nodes)))
