"""The cost of one layout (choices.Choice) on a cluster, without the cluster.

For each layout `estimate` works from abstract shapes only (an AbstractMesh
of the cluster's size, nothing allocated, nothing compiled):

  memory   the model states per device, exact from the shardings, plus an
           analytic estimate of what a step adds: gradient buffers, the
           activations the remat policy keeps (a pipeline: its stashed stage
           inputs and one chunk's), gathered ZeRO-3 weights;
  time     compute at the device's peak times its published efficiency, plus
           each mesh axis's collectives over that axis's link (inside a node
           or across nodes), with nothing overlapped: a pipeline's compute is
           the cost of its lockstep schedule (schedule.cost), bubble included.

With host offload (offload.py) the states in host memory leave the device's
bytes and count against the node's host memory; the host link's transfers
and the update on the host add to the time.

The search (scripts/plan.py) prunes with these, then compiles the best on
simulated CPU devices (`measure`) for the compiled memory and the collective
bytes of the real program, which replace the analytic traffic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import memory
from zero_jax import remat as remat_lib
from zero_jax.pipeline import schedule as sched_lib
from zero_jax.sharding import zero as zero_lib
from zero_jax.planner.choices import Choice, Cluster, pipeline_schedule
from zero_jax.sharding.specs import bytes_per_device, leaf_bytes, map_specs, shard_elements, spec_leaves, without_axis


@dataclasses.dataclass
class Estimate:
    """One layout's bytes per device and step time; figures in bytes and seconds."""

    choice: Choice
    state: dict[str, int]  # params, grads, opt_state as stored (memory.sharded)
    step_bytes: dict[str, float]  # temporaries at each phase of a step; the largest counts
    hbm: int
    compute_s: float  # the layers and head at peak x efficiency (a pipeline: its schedule's cost)
    comm_s: dict[str, float]  # per mesh axis, not overlapped
    bubble: float  # a pipeline's idle fraction of its schedule's cost
    tokens: int  # per step
    model_flops: float  # per step, 6 N + attention per token
    compiled: dict[str, Any] | None = None  # measure(): memory and collectives of the real program
    host: dict[str, int] = dataclasses.field(default_factory=dict)  # of `state`, in host memory
    host_step: float = 0.0  # host bytes a step adds: the gradient shard the update reads
    host_limit: float = 0.0  # this device's share of its node's host memory

    @property
    def analytic_bytes(self) -> float:
        """Device bytes: the states left on the device and the largest phase."""
        stored = sum(self.state[k] - self.host.get(k, 0) for k in ("params", "opt_state"))
        return stored + max(self.step_bytes.values())

    @property
    def host_bytes(self) -> float:
        """Host memory this device uses: its offloaded states and the update's gradients."""
        return sum(self.host.values()) + self.host_step

    @property
    def peak_bytes(self) -> float:
        """The figure that decides fitting: the analytic estimate. The CPU
        compile widens bf16 temporaries, so its figure is an upper bound."""
        return self.analytic_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm and self.host_bytes <= self.host_limit

    @property
    def headroom(self) -> float:
        return 1 - self.peak_bytes / self.hbm

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


def estimate(job: job_lib.Job, choice: Choice, cluster: Cluster, platform: str = "gpu") -> Estimate:
    """Analytic bytes and time of `choice`, with `job` the abstract job of
    its mesh, ZeRO stage and stage cut (the rest is read from `choice`).
    `platform` "cpu" models XLA:CPU's reduce-scatter (an all-reduce and a
    slice), to compare with programs compiled here."""
    layout, model, run = job.layout, job.model, job.run
    dev = cluster.device
    T = run.data.seq_len
    c = np.dtype(job.policy.dtype("compute")).itemsize
    g = np.dtype(layout.grad_dtype).itemsize
    state = memory.sharded(layout)
    split = memory.by_memory_kind(layout)
    on_device, in_host = split["device"], split["host"]
    stage = zero_lib.stage(choice.zero)
    compute_grads = bytes_per_device(layout.abstract_grads, layout.specs.compute, layout.mesh)
    outer_grads, stack_grads = _split_bytes(layout, layout.abstract_grads, layout.specs.compute)
    layers_here = layout.stages.padded // choice.pipe if choice.pipe > 1 else max(model.layers, 1)
    per_layer = stack_grads / layers_here  # one layer's gradient, compute layout
    seq_parallel = job.sequence_parallel
    rows = choice.micro
    policy = remat_lib.Remat(choice.remat)
    cfg = model.config
    if choice.pipe > 1:
        stages = layout.stages
        s = pipeline_schedule(choice)
        stash = s.max_in_flight() * rows * T * cfg.d_model * c
        # A backward tick rebuilds one chunk's layers (its slots); the last
        # stage's forward tick runs the head, whose logits it holds whole.
        acts = dataclasses.replace(cfg, n_layer=stages.slots).activation_parts(
            rows, T, c, policy, choice.tensor, seq_parallel, job.hooks.attention)
    else:
        acts = cfg.activation_parts(rows, T, c, policy, choice.tensor, seq_parallel,
                                    job.hooks.attention)
    # A step's temporaries peak in one of three phases, whose buffers XLA
    # reuses for one another (activations are dead when the optimizer runs):
    # the backward pass, the gradients' reduction, the update. Within the
    # backward pass the head's and a layer's working sets are never live
    # together: the larger counts. XLA:CPU copies the donated optimizer state
    # at the start of the program (the update selects between old and new
    # values, for skipped steps) and holds the copy throughout; a GPU's
    # memory-aware scheduler makes it at the update.
    held = on_device["opt_state"] if platform == "cpu" else 0.0
    per_microbatch = stage.params and not job.reduce_once
    layer_gathers = 2 * per_layer / g * c if stage.params else 0.0  # this layer's and the next
    if layout.host_params:  # and their stored shards, fetched from host memory
        _, stack_stored = _split_bytes(layout, layout.abstract.params, layout.specs.params)
        layer_gathers += 2 * stack_stored / layers_here
    if choice.pipe > 1:
        # Throughout: accumulators in the gradient layout (reduced each
        # microbatch) or the compute layout (partial sums), `pipe` left out
        # for the embedding and head, which are gathered whole for the step;
        # the stash. A forward tick of the last stage adds the head and the
        # embedding's and head's full gradient; a backward tick the rebuilt
        # chunk, its gradients and its layers' gathers. They are branches of
        # one switch: never live together.
        specs = layout.specs.grads if per_microbatch else layout.specs.compute
        outer_acc, _ = _split_bytes(layout, layout.abstract_grads, map_specs(
            lambda sp: without_axis(sp, "pipe"), specs))
        _, stack_acc = _split_bytes(layout, layout.abstract_grads, specs)
        base = outer_acc + stack_acc + outer_grads / g * c + stash
        forward = acts.head + outer_grads
        backward_tick = acts.kept + acts.rebuilt + stack_acc / choice.virtual + layer_gathers
        backward = base + max(forward, backward_tick)
    elif per_microbatch:  # ZeRO-3, reduced on the spot: the shard, one layer's full gradient
        tied = _gathered_once(layout, model)  # gathered once, its gradient kept per batch shard
        base = state["grads"] + acts.kept + tied * c
        layer = acts.rebuilt + tied * g + 2 * per_layer + layer_gathers
        backward = base + max(acts.head, layer)
    else:  # full-size partial sums in the compute layout, and the microbatch's own gradients
        base = compute_grads * (2 if choice.microbatches > 1 else 1) + acts.kept
        backward = base + max(acts.head, acts.rebuilt + layer_gathers)
    backward += held
    # Reducing partial sums into a sharded layout: a reduce-scatter, which
    # XLA:CPU lowers to an all-reduce (a full-size result) and a slice, one
    # array at a time: the partial sums and the largest array's result.
    sharded_result = _largest(layout, layout.abstract_grads, layout.specs.compute) \
        if platform == "cpu" else state["grads"]
    reduction = compute_grads + sharded_result + held if (stage.grads and not per_microbatch) else 0.0
    # The update: the gradients, two float32 working copies of the parameters
    # in the optimizer's layout (new moments before they replace the donated
    # ones), and, with a replicated working copy, the gathered new parameters.
    opt_specs = layout.specs.sharded if stage.opt_state else layout.specs.params
    f32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, np.float32), layout.abstract.params)
    opt_elements = bytes_per_device(f32, opt_specs, layout.mesh) / 4  # the update's shard
    working = state["params"] if stage.opt_state and not stage.params else 0.0
    if layout.host_opt:
        # Run on the host (offload.py): the device holds the gradients it
        # sends and the new parameters that come back beside the old.
        update = state["grads"] + on_device["params"]
    else:  # offloaded parameters alone are fetched whole for an update on the device
        update = state["grads"] + 8 * opt_elements + working + in_host["params"]
    step_bytes = {"backward": backward, "reduction": reduction, "update": update}

    tokens = choice.data * choice.micro * choice.microbatches * T
    flops_token = model.flops_per_token(T)
    model_flops = flops_token * tokens
    rate = dev.peak_flops * dev.efficiency
    layer_fwd = (8 * cfg.d_model ** 2 + 4 * cfg.d_model * cfg.d_mlp + 4 * T * cfg.d_model) * rows * T
    recompute = choice.remat == "full"
    comm = {}
    if choice.pipe > 1:
        backward = 4 if recompute else 3  # the chunk's recompute, plus each block's under full remat
        cost = sched_lib.cost(s, stages.counts, head=model.head_cost(T), backward=backward)
        compute = cost.total * layer_fwd / choice.tensor / rate
        bubble = cost.bubble
        act_bytes = rows * T * cfg.d_model * c / (choice.tensor if seq_parallel else 1)
        comm["pipe"] = s.ticks * act_bytes / choice.link_bw(cluster, "pipe")
    else:
        hardware = model_flops * ((4 / 3) if recompute else 1.0)
        compute = hardware / cluster.size / rate
        bubble = 0.0
    # Tensor parallelism: per layer and microbatch, two all-reduces of the
    # activations forward and two backward (two more to recompute).
    if choice.tensor > 1:
        t = choice.tensor
        per = (6 if (recompute or choice.pipe > 1) else 4) * rows * T * cfg.d_model * c
        layers_here = cfg.n_layer / choice.pipe
        comm["tensor"] = (choice.microbatches * layers_here * per * 2 * (t - 1) / t
                          / choice.link_bw(cluster, "tensor"))
    if layout.host_opt or layout.host_params:
        comm.update(_host_time(layout, choice, cluster, in_host, opt_elements, on_device, c, g))
    if choice.data > 1:
        n = choice.data
        psi = compute_grads / g  # parameters this device computes with
        reductions = choice.microbatches if (stage.params and not job.reduce_once) else 1
        grad_bytes = psi * g * reductions * (2 if not stage.grads else 1) * (n - 1) / n
        gathers = (2 * choice.microbatches if stage.params else 1 if stage.opt_state else 0)
        param_bytes = psi * c * gathers * (n - 1) / n
        comm["data"] = (grad_bytes + param_bytes) / choice.link_bw(cluster, "data")
    return Estimate(choice, state, step_bytes, dev.hbm_bytes, compute, comm, bubble, tokens,
                    model_flops, host=in_host,
                    host_step=opt_elements * g if layout.host_opt else 0.0,
                    host_limit=dev.host_bytes_per_node / cluster.per_node)


# Bytes of host memory the update reads and writes per parameter it updates:
# the float32 master and two Adam moments read and written (24), the
# gradient read, the new working parameter written.
UPDATE_TOUCHES = 24


def _host_time(layout, choice: Choice, cluster: Cluster, in_host: dict, opt_elements: float,
               on_device: dict, c: int, g: int) -> dict[str, float]:
    """Seconds per step over the host link and in the host's update, not
    overlapped. Under optimizer offload each device sends its shard of the
    gradients (g bytes per parameter it updates) and receives the new
    parameters it stores on the device (its working shard at ZeRO-1/2, its
    stored shard at ZeRO-3); the update streams the optimizer state through
    host memory, whose bandwidth the node's devices share (a floor: a host
    update reaches a fraction of it). Under parameter offload every
    microbatch fetches the stored shards forward and backward, and again
    to recompute under full remat."""
    dev = cluster.device
    link = 0.0
    out = {}
    if layout.host_opt:
        back = on_device["params"] if zero_lib.stage(layout.zero_stage).params else opt_elements * c
        link += opt_elements * g + back
        touched = opt_elements * (UPDATE_TOUCHES + g + c)
        out["host update"] = touched / (dev.host_mem_bw / cluster.per_node)
    if layout.host_params:
        fetches = 3 if choice.remat == "full" else 2
        link += in_host["params"] * fetches * choice.microbatches
    out["host link"] = link / dev.host_link_bw
    return out


def _split_bytes(layout, abstract, specs) -> tuple[float, float]:
    """Bytes per device of `abstract` laid out by `specs`: (outside the layer stack, the stack)."""
    out = [0.0, 0.0]
    for size, stacked in zip(leaf_bytes(abstract, specs, layout.mesh),
                             jax.tree.leaves(layout.stacked[0])):
        out[bool(stacked)] += size
    return out[0], out[1]


def _largest(layout, abstract, specs) -> float:
    """Bytes per device of the largest array of `abstract` laid out by `specs`."""
    return max(leaf_bytes(abstract, specs, layout.mesh))


def _gathered_once(layout, model) -> float:
    """Elements a device holds of the parameters the model gathers once (ZeRO-3)."""
    return float(sum(
        shard_elements(leaf.shape, jax.sharding.NamedSharding(layout.mesh, spec))
        for key in model.gathered_once
        for leaf, spec in zip(jax.tree.leaves(layout.abstract.params.get(key, {})),
                              spec_leaves(layout.specs.compute.get(key, {})))))


RING = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
        "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
        "collective-permute": lambda n: 1.0}


def with_measured(est: Estimate, measured: dict[str, Any], cluster: Cluster) -> Estimate:
    """`est` with the compiled program's figures: its memory beside the
    estimate, and its collective bytes per axis in place of the analytic
    traffic (payload x ring factor over the axis's link)."""
    sizes = {"pipe": est.choice.pipe, "data": est.choice.data, "tensor": est.choice.tensor, "fsdp": 1}
    comm: dict[str, float] = {}
    for key, payload in measured["collectives"].items():
        op, _, axes = key.partition("@")
        names = [a for a in axes.split(",") if a in sizes] or ["data"]
        n = math.prod(sizes[a] for a in names)
        link = min(est.choice.link_bw(cluster, a) for a in names)
        where = "+".join(names)
        comm[where] = comm.get(where, 0.0) + payload * RING.get(op, RING["all-gather"])(max(n, 2)) / link
    if est.choice.pipe > 1:  # the schedule's sends stay as the cost model counts them
        comm["pipe"] = est.comm_s.get("pipe", 0.0)
    for key in ("host link", "host update"):  # no collectives: as estimated
        if key in est.comm_s:
            comm[key] = est.comm_s[key]
    return dataclasses.replace(est, comm_s=comm, compiled=measured)


def measure(flat: dict[str, Any], build_model) -> dict[str, Any]:
    """Compile the run on this process's devices: memory and collective bytes."""
    run = config_lib.build(None, flat)
    job = job_lib.prepare(run, build_model)
    compiled, text = job.compile_with_text()
    m = memory.compiled(compiled)
    traffic = job.collectives(text).measured
    return {"argument_bytes": m["argument_bytes"], "temp_bytes": m["temp_bytes"],
            "collectives": traffic.by_op, "collective_bytes": traffic.total}
