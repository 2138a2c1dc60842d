"""The time of one training step of a layout, estimated from its shapes.

Every part has a source (the device figures' are beside them in
meshes/devices/*.toml, the published runs it is checked against in
docs/planning.md#published-runs). It is an estimate: the largest
uncertainty is the step efficiency, one figure per device kind fitted to
those runs, which holds whatever the kernel model does not list.

  compute  each layer's kernels from their shapes (kernels.py): GEMMs on a
           roofline with tile and wave quantisation, attention fused or
           written out, element-wise work by the bytes it moves; forward
           passes (recomputation included), backward, the head, the
           update. A pipeline's compute is its schedule's cost
           (schedule.cost): each tick as long as its slowest stage, then
           its sends, so the bubble and the pipe traffic are in it.
  tensor   the activations' all-reduces (sequence parallel: all-gathers and
           reduce-scatters), on the critical path: the next product needs
           them. Two per layer and forward pass, two per backward;
           stretched by a pipeline's idle fraction, as its compute.
  data     the gradient reduction, layer by layer, starts as each layer's
           gradient is ready (XLA's latency-hiding scheduler), so the last
           microbatch's backward hides as much of it as it lasts; ZeRO-3's
           per-layer gathers are prefetched one layer ahead, and they and
           its per-microbatch reductions share the link behind the
           microbatch's compute: what exceeds it waits, and so does the
           first gather; ZeRO-1/2's gather of the updated parameters, after
           the update, is exposed.
  host     offload's transfers and the update on the host, not overlapped.

Each collective costs a latency plus its bytes over the slowest link it
crosses, on a ring or a tree (links.py).

No layout is predicted above the device kind's best published MFU
(`mfu_ceiling`) unless the kind carries a measured GEMM sweep.
"""

from __future__ import annotations

import dataclasses

from zero_jax import job as job_lib
from zero_jax.analysis import memory
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.planner import choices, kernels, links
from zero_jax.planner.choices import Choice, Cluster, pipeline_schedule
from zero_jax.planner.step_bytes import (compute_grad_bytes, dtype_bytes, frozen_bytes,
                                         reduces_each_microbatch, tables_in_blocks,
                                         update_elements)
from zero_jax.sharding import quantized
from zero_jax.sharding import zero as zero_lib

# Bytes of host memory the update reads and writes per parameter it updates:
# the float32 master and two Adam moments read and written (24), the
# gradient read, the new working parameter written.
UPDATE_TOUCHES = 24


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step of a layout, and the work it does."""

    compute_s: float  # the kernels' time (a pipeline: its schedule's cost)
    comm_s: dict[str, float]  # per mesh axis, and the host link and update: the exposed part
    bubble: float  # a pipeline's idle fraction of its schedule's cost
    tokens: int  # per step
    model_flops: float  # per step, 6 N + attention per token
    # per step as Megatron counts them: model, + every layer's forward where the layout recomputes
    hardware_flops: float = 0.0
    hidden_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per axis: what overlap hides
    floor_s: float = 0.0  # the step at the device kind's best published MFU (mfu_ceiling)

    def exposed(self, axis: str, seconds: float) -> float:
        """Of `seconds` of `axis`'s traffic (measured in a compiled program),
        what this model leaves on the critical path."""
        if axis == "tensor":
            return seconds / (1 - self.bubble)
        return max(0.0, seconds - self.hidden_s.get(axis, 0.0))

    @property
    def step_s(self) -> float:
        return max(self.compute_s + sum(self.comm_s.values()), self.floor_s)

    @property
    def at_ceiling(self) -> bool:
        """Whether the MFU ceiling, not the model, sets the step time."""
        return self.floor_s > self.compute_s + sum(self.comm_s.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    def tflops_per_device(self, devices: int) -> float:
        """Model TFLOP/s (6 N + attention) per device."""
        return self.model_flops / self.step_s / devices / 1e12

    def hardware_tflops_per_device(self, devices: int) -> float:
        """Megatron-formula TFLOP/s per device (recomputation included),
        what Megatron-LM and Megatron-DeepSpeed papers report."""
        return self.hardware_flops / self.step_s / devices / 1e12

    def mfu(self, devices: int, peak: float) -> float:
        return self.model_flops / self.step_s / devices / peak


@dataclasses.dataclass(frozen=True)
class _Work:
    """What one layer does per microbatch, and how often the step does it."""

    layer_flops: float  # one layer's forward, one microbatch, whole (not split over tensor)
    passes: int  # forward passes of each layer: 1, + the pipeline's rebuild, + full remat's
    times: kernels.LayerTimes  # its kernels' seconds on one device


def _work(job: job_lib.Job, choice: Choice, cluster: Cluster) -> _Work:
    T = job.run.data.seq_len
    per_token = sum(op.flops for op in job.model.block_ops(T))
    passes = 1 + (choice.pipe > 1) + (choice.remat == "full")
    rows = choice.micro * T / choice.context  # a device's tokens: its block of each row
    times = kernels.layer_times(job, choice, cluster.device, job.hooks.attention)
    return _Work(per_token * rows, passes, times)


def step_time(job: job_lib.Job, choice: Choice, cluster: Cluster) -> StepTime:
    """Compute and communication of `choice` on `cluster`, with `job` the
    abstract job of its mesh, ZeRO stage and stage cut."""
    T = job.run.data.seq_len
    tokens = choice.data * choice.micro * choice.microbatches * T
    model_flops = job.model.flops_per_token(T) * tokens
    work = _work(job, choice, cluster)
    layers = job.model.config.n_layer
    # Megatron's count (Narayanan et al. 2021, eq. 3): where the layout
    # recomputes (full remat, or a pipeline stage rebuilt in its backward),
    # every layer's whole forward once more, the head's not; where it
    # recomputes nothing, the model's FLOPs.
    layer_part = work.layer_flops * layers * choice.microbatches * choice.data * choice.context
    hardware = model_flops + (layer_part if work.passes > 1 else 0.0)
    comm = {}
    if choice.pipe > 1:
        compute, bubble = _pipeline_compute(job, choice, cluster, work)
    else:
        compute, bubble = _compute(job, choice, work), 0.0
    if choice.tensor > 1:
        comm["tensor"] = _tensor_time(job, choice, cluster, work) / (1 - bubble)
    if choice.expert > 1:
        comm["expert"] = _expert_time(job, choice, cluster, work) / (1 - bubble)
    if choice.context > 1:
        comm["context"] = _context_time(job, choice, cluster, work) / (1 - bubble)
    if job.state_plan.host_opt or job.state_plan.host_params:
        comm.update(_host_time(job, choice, cluster))
    hidden = {}
    if choice.data * choice.context > 1:
        total, comm["data"] = _data_time(job, choice, cluster, work)
        hidden["data"] = total - comm["data"]
    devices = choice.pipe * choice.tensor * choice.data * choice.context
    dev = cluster.device
    floor = 0.0 if dev.gemm_sweep else model_flops / devices / (dev.peak_flops * dev.mfu_ceiling)
    return StepTime(compute, comm, bubble, tokens, model_flops, hardware, hidden, floor)


def _compute(job: job_lib.Job, choice: Choice, work: _Work) -> float:
    """Without a pipeline: each layer's forward passes and its backward,
    the head's forward and backward, per microbatch; the update once."""
    t = work.times
    per_mb = (job.model.config.n_layer * (work.passes * t.forward + t.backward)
              + t.head_forward + t.head_backward)
    return per_mb * choice.microbatches + t.update


def _pipeline_compute(job: job_lib.Job, choice: Choice, cluster: Cluster,
                      work: _Work) -> tuple[float, float]:
    """Seconds and idle fraction of the schedule: in layer-forward units a
    backward rebuilds its chunk (1), runs the backward proper and, under
    full remat, rebuilds each block again inside it (1); a split backward
    leaves the weight products (W) for later. Each tick's sends are one
    microbatch's activation, split over tensor under sequence parallelism.
    With the tables in row blocks over `pipe`, every stage shares the head's
    work, and each end of a microbatch adds ring all-reduces of such an
    activation over `pipe` (schedule.cost `shared_ends`)."""
    t = work.times
    unit = t.forward
    link = choice.link(cluster, "pipe")
    activation = _activation_bytes(job, choice)
    send = links.collective_s("collective-permute", activation, 2, link) / unit
    prices = schedule_lib.Prices(head=(t.head_forward + t.head_backward) / 3 / unit, send=send,
                                 backward=work.passes - 1 + t.backward / unit,
                                 weight=t.weight / unit,
                                 end_sum=links.collective_s("all-reduce", activation, choice.pipe,
                                                            link) / unit)
    cost = schedule_lib.cost(pipeline_schedule(choice), job.state_plan.stages.counts, prices,
                             shared_ends=any(tables_in_blocks(job, choice)))
    return cost.total * unit + t.update, cost.bubble


def _activation_bytes(job: job_lib.Job, choice: Choice) -> float:
    """One microbatch's activation on one device."""
    c, _ = dtype_bytes(job)
    return (choice.micro * job.run.data.seq_len / choice.context * job.model.config.d_model * c
            / (choice.tensor if job.sequence_parallel else 1))


def _tensor_time(job: job_lib.Job, choice: Choice, cluster: Cluster, work: _Work) -> float:
    """Per layer and microbatch, two all-reduces of the activations per
    forward pass and two in the backward (sequence parallel: each an
    all-gather and a reduce-scatter), over this device's layers."""
    c, _ = dtype_bytes(job)
    t, link = choice.tensor, choice.link(cluster, "tensor")
    payload = choice.micro * job.run.data.seq_len / choice.context * job.model.config.d_model * c
    one = (links.collective_s("all-gather", payload, t, link)
           + links.collective_s("reduce-scatter", payload, t, link) if job.sequence_parallel
           else links.collective_s("all-reduce", payload, t, link))
    layers_here = job.model.config.n_layer / choice.pipe
    return choice.microbatches * layers_here * (2 * work.passes + 2) * one


def _expert_time(job: job_lib.Job, choice: Choice, cluster: Cluster, work: _Work) -> float:
    """Per mixture-of-experts layer and microbatch, the exchanges over
    `expert` there and back, per forward pass and in the backward
    (models/llama/moe.py, two_hop.py, zero_jax/model/exchange.py).

    Direct, a device sends its k copies per token: ragged (sized by the
    counts, the exchange a GPU or TPU compiles) the routed copies, padded
    one block per peer sized for all of them, e times that. Over an expert
    axis of e devices on m nodes, evenly routed, 1 - 1/m of the copies leave
    the node (over the inter-node link) and the rest move over the node's
    own; each part is priced on its link and the slower one counts.

    In two hops (`choices.ExpertSpan.two_hops`), a token crosses the inter-node
    link once per other node it needs, at most min(reach, m - 1), then all
    k copies fan out inside the node: the two hops one after the other,
    each on its own link."""
    c, _ = dtype_bytes(job)
    e, cfg = choice.expert, job.model.config
    tokens = choice.micro * job.run.data.seq_len / choice.context
    copies = tokens * cfg.n_experts_per_tok * cfg.d_model * c
    span = choices.expert_span(cfg, job.run.model.expert_dispatch, choice, cluster)
    here, nodes = span.per_node, span.nodes
    dev = cluster.device
    off = links.Link(dev.inter_node_bw, dev.inter_node_latency, dev.collective_latency)
    on = links.Link(dev.intra_node_bw, dev.intra_node_latency, dev.collective_latency)
    if span.two_hops:
        # Each device sends to the same slot on the other nodes: m - 1 of m peers.
        rows = tokens * min(span.reach, nodes - 1) * cfg.d_model * c * nodes / (nodes - 1)
        one = (links.collective_s("all-to-all", rows, nodes, off)
               + links.collective_s("all-to-all", copies, here, on))
    else:
        payload = copies if job.hooks.expert_exchange == "ragged" else e * copies
        if nodes == 1:
            one = links.collective_s("all-to-all", payload, e, choice.link(cluster, "expert"))
        else:
            # The ring factor (e - 1) / e splits into (e - here) / e off the node,
            # (here - 1) / e on it.
            one = max(links.collective_s("all-to-all", payload * (e - here) / (e - 1), e, off),
                      links.collective_s("all-to-all", payload * (here - 1) / (e - 1), e, on)
                      if here > 1 else 0.0)
    # The mixture layers only (DeepSeek's first layers are dense), and each MTP module's.
    layers_here = (cfg.moe_layers + cfg.mtp_depth) / choice.pipe
    return choice.microbatches * layers_here * (2 * work.passes + 2) * one


def _context_time(job: job_lib.Job, choice: Choice, cluster: Cluster, work: _Work) -> float:
    """Per layer and microbatch, what attention moves over `context`
    (docs/context.md, counted exactly in tests/test_context.py), charged
    whole: ring, each device's K and V blocks passed on c - 1 times forward
    (again when full remat rebuilds the block), c - 1 times backward and
    their gradients c times; Ulysses, q, k, v and the output each way,
    forward (again under full remat) and backward, (c - 1) / c of each over
    the link; all-gather, K and V gathered per forward pass and backward,
    their gradients reduce-scattered. An estimate: the ring's transfers
    overlap its blocks' compute on a GPU, which this does not credit."""
    c_bytes, _ = dtype_bytes(job)
    ctx, cfg, cp, t = job.hooks.context, job.model.config, choice.context, choice.tensor
    link = choice.link(cluster, "context")
    tokens = choice.micro * job.run.data.seq_len / cp  # a device's block of its rows
    H, Q = cfg.n_head, getattr(cfg, "q_dim", cfg.d_model // cfg.n_head)
    K = getattr(cfg, "n_kv_head", H)
    kv = tokens * max(K // t, 1) * Q * c_bytes  # one device's K (or V)
    forwards = work.passes  # forward passes of each layer (1, or 2 under full remat)
    if ctx.strategy == "ring":
        passes = (cp - 1) * forwards + (cp - 1) + cp  # K and V (or their gradients) sent together
        per = passes * links.collective_s("collective-permute", 2 * kv, 2, link)
    elif ctx.strategy == "ulysses":
        heads = tokens * (H // t) * Q * c_bytes
        per = 4 * (forwards + 1) * links.collective_s("all-to-all", heads, cp, link)
    else:  # all-gather
        per = (2 * (forwards + 1) * links.collective_s("all-gather", kv * cp, cp, link)
               + 2 * links.collective_s("reduce-scatter", kv * cp, cp, link))
    layers_here = cfg.n_layer / choice.pipe
    return choice.microbatches * layers_here * per


def _data_time(job: job_lib.Job, choice: Choice, cluster: Cluster,
               work: _Work) -> tuple[float, float]:
    """Seconds of the data-parallel traffic, and of them the exposed part
    (module docstring). Each layer's parameters are gathered, and its
    gradients reduced, as one collective."""
    c, g = dtype_bytes(job)
    # Gradients are reduced, and ZeRO shards, over data and context alike.
    n = choice.data * choice.context
    link = choice.link(cluster, *(a for a in ("data", "context") if getattr(choice, a) > 1))
    stage = zero_lib.stage(choice.zero)
    psi = compute_grad_bytes(job.state_plan) / g  # parameters this device computes with
    layers_here = max(job.state_plan.stages.padded // choice.pipe if choice.pipe > 1
                      else job.model.config.n_layer, 1)
    t = work.times
    backward = layers_here * (t.forward * (work.passes - 1) + t.backward)  # one microbatch's
    reduce = "reduce-scatter" if stage.grads else "all-reduce"
    each_microbatch = reduces_each_microbatch(job, stage)
    base = sum(frozen_bytes(job.state_plan))  # LoRA's frozen base, gathered as it is stored
    stored_c = c
    c, g, reduce = _quantized(job, c, g, reduce, stage.params and each_microbatch)
    if job.model.lora and job.model.lora.quantize_base == "none":
        base *= c / stored_c  # in qwZ's or FP8's bytes, as the parameters are
    grads = layers_here * links.collective_s(reduce, psi * g / layers_here, n, link)
    if stage.params:
        # Per microbatch the link carries each layer's gathers (forward
        # passes and backward), prefetched a layer ahead, and with ZeRO-3's
        # on-the-spot reduction the gradients: what exceeds the
        # microbatch's compute waits, and so does the first gather.
        layer_gather = links.collective_s("all-gather", (psi * c + base) / layers_here, n, link)
        per_mb = layers_here * (work.passes + 1) * layer_gather + grads * each_microbatch
        compute = layers_here * (t.forward * work.passes + t.backward)
        total = choice.microbatches * per_mb
        exposed = choice.microbatches * max(0.0, per_mb - compute) + layer_gather
        if not each_microbatch:
            total, exposed = total + grads, exposed + max(0.0, grads - backward)
        return total, exposed
    times = choice.microbatches if each_microbatch else 1
    total, exposed = times * grads, times * max(0.0, grads - backward)
    if stage.opt_state:  # the updated shards gathered after the update
        gather = layers_here * links.collective_s("all-gather", psi / layers_here * c, n, link)
        total += gather
        exposed += gather
    return total, exposed


def _quantized(job: job_lib.Job, c: float, g: float, reduce: str,
               on_the_spot: bool) -> tuple[float, float, str]:
    """Bytes per element gathered and reduced, and the reduction, under
    ZeRO++ (sharding/quantized.py): a byte and a float32 scale per block
    for every ZeRO-3 gather (qwZ) and, reduced on the spot, every gradient
    (qgZ, an all-to-all); FP8 products' weights a byte each. Every
    parameter is counted as a product's (the embedding's and norms' few are
    not quantized: a slight underestimate of the bytes)."""
    h = job.hooks
    if h.int8_gather_block:
        c = 1 + quantized.SCALE_BYTES / h.int8_gather_block
    elif h.fp8:
        c = 1
    if h.int8_reduce_block and on_the_spot:
        g, reduce = 1 + quantized.SCALE_BYTES / h.int8_reduce_block, "all-to-all"
    return c, g, reduce


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
    state_plan, dev = job.state_plan, cluster.device
    c, g = dtype_bytes(job)
    split = memory.by_memory_kind(state_plan)
    link = 0.0
    out = {}
    if state_plan.host_opt:
        elements = update_elements(state_plan, zero_lib.stage(choice.zero))
        params_sharded = zero_lib.stage(state_plan.zero_stage).params
        back = split["device"]["params"] if params_sharded else elements * c
        link += elements * g + back
        touched = elements * (UPDATE_TOUCHES + g + c)
        out["host update"] = touched / (dev.host_mem_bw / cluster.per_node)
    if state_plan.host_params:
        fetches = 3 if choice.remat == "full" else 2
        link += split["host"]["params"] * fetches * choice.microbatches
    out["host link"] = link / dev.host_link_bw
    return out
