"""The time of one training step of a layout, estimated from its shapes.

Compute runs at the device's peak times its published efficiency; a
pipeline's compute is the cost of its lockstep schedule (schedule.cost),
bubble included. Each mesh axis's collectives run over that axis's link
(inside a node or across nodes) as ring traffic: an all-reduce moves
2(n-1)/n of its payload per device, an all-gather or a reduce-scatter
(n-1)/n. Nothing is overlapped: the figure is conservative. With host
offload (offload.py) the host link's transfers and the update on the host
add to the time.
"""

from __future__ import annotations

import dataclasses

from zero_jax import job as job_lib
from zero_jax.analysis import memory
from zero_jax.pipeline import schedule as sched_lib
from zero_jax.planner.choices import Choice, Cluster, pipeline_schedule
from zero_jax.planner.step_bytes import (compute_grad_bytes, dtype_bytes, reduces_each_microbatch,
                                         update_elements)
from zero_jax.sharding import zero as zero_lib

# Bytes of host memory the update reads and writes per parameter it updates:
# the float32 master and two Adam moments read and written (24), the
# gradient read, the new working parameter written.
UPDATE_TOUCHES = 24


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step of a layout, and the work it does."""

    compute_s: float  # the layers and head at peak x efficiency (a pipeline: its schedule's cost)
    comm_s: dict[str, float]  # per mesh axis, and the host link and update; not overlapped
    bubble: float  # a pipeline's idle fraction of its schedule's cost
    tokens: int  # per step
    model_flops: float  # per step, 6 N + attention per token

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    def tflops_per_device(self, devices: int) -> float:
        return self.model_flops / self.step_s / devices / 1e12

    def mfu(self, devices: int, peak: float) -> float:
        return self.model_flops / self.step_s / devices / peak


def step_time(job: job_lib.Job, choice: Choice, cluster: Cluster) -> StepTime:
    """Compute and communication of `choice` on `cluster`, with `job` the
    abstract job of its mesh, ZeRO stage and stage cut."""
    T = job.run.data.seq_len
    tokens = choice.data * choice.micro * choice.microbatches * T
    model_flops = job.model.flops_per_token(T) * tokens
    comm = {}
    if choice.pipe > 1:
        compute, bubble = _pipeline_compute(job, choice, cluster)
        comm["pipe"] = _pipe_time(job, choice, cluster)
    else:
        compute, bubble = _compute(model_flops, choice, cluster), 0.0
    if choice.tensor > 1:
        comm["tensor"] = _tensor_time(job, choice, cluster)
    if job.layout.host_opt or job.layout.host_params:
        comm.update(_host_time(job, choice, cluster))
    if choice.data > 1:
        comm["data"] = _data_time(job, choice, cluster)
    return StepTime(compute, comm, bubble, tokens, model_flops)


def _rate(cluster: Cluster) -> float:
    """FLOP/s one device sustains: its peak times its published efficiency."""
    return cluster.device.peak_flops * cluster.device.efficiency


def _compute(model_flops: float, choice: Choice, cluster: Cluster) -> float:
    """The step's FLOPs spread evenly over the devices; full remat runs the
    forward pass twice (4/3 of forward and backward)."""
    hardware = model_flops * ((4 / 3) if choice.remat == "full" else 1.0)
    return hardware / cluster.size / _rate(cluster)


def _pipeline_compute(job: job_lib.Job, choice: Choice, cluster: Cluster) -> tuple[float, float]:
    """Seconds and idle fraction of the lockstep schedule, each tick as long
    as its slowest stage. A backward tick costs 3 forwards per layer (the
    chunk rebuilt from its stashed input, then the backward proper), 4 under
    full remat, which recomputes each block again inside it."""
    cfg, T = job.model.config, job.run.data.seq_len
    layer_fwd = ((8 * cfg.d_model ** 2 + 4 * cfg.d_model * cfg.d_mlp + 4 * T * cfg.d_model)
                 * choice.micro * T)
    backward = 4 if choice.remat == "full" else 3
    cost = sched_lib.cost(pipeline_schedule(choice), job.layout.stages.counts,
                          head=job.model.head_cost(T), backward=backward)
    return cost.total * layer_fwd / choice.tensor / _rate(cluster), cost.bubble


def _pipe_time(job: job_lib.Job, choice: Choice, cluster: Cluster) -> float:
    """One microbatch's activations sent between stages every tick (split
    over tensor under sequence parallelism)."""
    c, _ = dtype_bytes(job)
    act_bytes = (choice.micro * job.run.data.seq_len * job.model.config.d_model * c
                 / (choice.tensor if job.sequence_parallel else 1))
    return pipeline_schedule(choice).ticks * act_bytes / choice.link_bw(cluster, "pipe")


def _tensor_time(job: job_lib.Job, choice: Choice, cluster: Cluster) -> float:
    """Per layer and microbatch, two all-reduces of the activations forward
    and two backward (two more to recompute: full remat, or a pipeline's
    rebuilt chunk)."""
    c, _ = dtype_bytes(job)
    t, d_model = choice.tensor, job.model.config.d_model
    recompute = choice.remat == "full" or choice.pipe > 1
    per = (6 if recompute else 4) * choice.micro * job.run.data.seq_len * d_model * c
    layers_here = job.model.config.n_layer / choice.pipe
    return (choice.microbatches * layers_here * per * 2 * (t - 1) / t
            / choice.link_bw(cluster, "tensor"))


def _data_time(job: job_lib.Job, choice: Choice, cluster: Cluster) -> float:
    """The gradients reduced over data (an all-reduce, or a reduce-scatter
    when they are stored sharded), once per step or, ZeRO-3 reducing on the
    spot, per microbatch; the parameters gathered: at ZeRO-3 forward and
    backward per microbatch, at ZeRO-1 and 2 once after the update."""
    c, g = dtype_bytes(job)
    n = choice.data
    stage = zero_lib.stage(choice.zero)
    psi = compute_grad_bytes(job.layout) / g  # parameters this device computes with
    reductions = choice.microbatches if reduces_each_microbatch(job, stage) else 1
    grad_bytes = psi * g * reductions * (2 if not stage.grads else 1) * (n - 1) / n
    gathers = (2 * choice.microbatches if stage.params else 1 if stage.opt_state else 0)
    param_bytes = psi * c * gathers * (n - 1) / n
    return (grad_bytes + param_bytes) / choice.link_bw(cluster, "data")


def _host_time(job: job_lib.Job, choice: Choice, cluster: Cluster) -> dict[str, float]:
    """Seconds per step over the host link and in the host's update, not
    overlapped. Under optimizer offload each device sends its shard of the
    gradients (g bytes per parameter it updates) and receives the new
    parameters it stores on the device (its working shard at ZeRO-1/2, its
    stored shard at ZeRO-3); the update streams the optimizer state through
    host memory, whose bandwidth the node's devices share (a floor: a host
    update reaches a fraction of it). Under parameter offload every
    microbatch fetches the stored shards forward and backward, and again
    to recompute under full remat."""
    layout, dev = job.layout, cluster.device
    c, g = dtype_bytes(job)
    split = memory.by_memory_kind(layout)
    link = 0.0
    out = {}
    if layout.host_opt:
        elements = update_elements(layout, zero_lib.stage(choice.zero))
        params_sharded = zero_lib.stage(layout.zero_stage).params
        back = split["device"]["params"] if params_sharded else elements * c
        link += elements * g + back
        touched = elements * (UPDATE_TOUCHES + g + c)
        out["host update"] = touched / (dev.host_mem_bw / cluster.per_node)
    if layout.host_params:
        fetches = 3 if choice.remat == "full" else 2
        link += split["host"]["params"] * fetches * choice.microbatches
    out["host link"] = link / dev.host_link_bw
    return out
